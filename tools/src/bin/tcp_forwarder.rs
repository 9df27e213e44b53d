//! `tcp-forwarder`: forwards every connection it accepts on `--listen` to
//! `--to`, byte for byte, in both directions. A fault tool for tests and the
//! chaos soak: put one between a replica and Redis, and `kill -STOP` it to
//! cut that replica off in silence (its sockets stay open, nothing is reset,
//! nothing arrives), `kill -CONT` to heal the link with every byte sent
//! meanwhile still delivered. Closing either side closes the other.
//!
//! A line `forget` on its standard input makes every connection open now
//! a black hole for good (what a NAT or a stateful firewall that lost its
//! flow table does): its sockets stay open, whatever arrives is dropped,
//! nothing is sent or reset. Connections made afterwards work.
//!
//! Prints `listening on ADDR` once it accepts connections.

use std::io::{BufRead, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread;

use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Forwards TCP connections from --listen to --to (a fault tool: SIGSTOP it)")]
struct Args {
    /// Where to accept connections, e.g. 127.0.0.1:0 (a free port).
    #[arg(long)]
    listen: String,
    /// Where to forward each connection, e.g. 127.0.0.1:6379.
    #[arg(long)]
    to: String,
}

/// Copies `from` to `to` until `from` ends or either fails, then shuts `to`
/// for writing so the far side sees the end too. Once `forgotten`, what is
/// read is dropped, and nothing is closed.
fn pump(mut from: TcpStream, mut to: TcpStream, forgotten: Arc<AtomicBool>) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) if forgotten.load(Ordering::Relaxed) => continue,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    if forgotten.load(Ordering::Relaxed) {
        // Silence to the end: the other side is never told.
        return;
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}

fn main() {
    let args = Args::parse();
    let listener = match TcpListener::bind(&args.listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("tcp-forwarder: cannot listen on {}: {e}", args.listen);
            std::process::exit(2);
        }
    };
    match listener.local_addr() {
        Ok(a) => println!("listening on {a}"),
        Err(e) => {
            eprintln!("tcp-forwarder: {e}");
            std::process::exit(2);
        }
    }
    // One flag per connection; `forget` sets those of the connections open.
    let flows: Arc<Mutex<Vec<Weak<AtomicBool>>>> = Arc::default();
    {
        let flows = flows.clone();
        thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if line.trim() == "forget" {
                    let mut flows = flows.lock().expect("flows");
                    flows.retain(|f| match f.upgrade() {
                        Some(f) => {
                            f.store(true, Ordering::Relaxed);
                            false
                        }
                        None => false,
                    });
                }
            }
        });
    }
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        let to = args.to.clone();
        let forgotten = Arc::new(AtomicBool::new(false));
        flows
            .lock()
            .expect("flows")
            .push(Arc::downgrade(&forgotten));
        thread::spawn(move || {
            let Ok(server) = TcpStream::connect(&to) else {
                // Refused upstream: the client sees its connection closed.
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else {
                return;
            };
            let f2 = forgotten.clone();
            let up = thread::spawn(move || pump(client, server, f2));
            pump(s2, c2, forgotten);
            let _ = up.join();
        });
    }
}
