//! A relay to Redis that holds one call's answer: the call runs in Redis,
//! in time, and the gateway never hears that it did (see `AnswerHold`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::wait_for;

/// A relay to Redis that can freeze: while `hold` is set nothing passes
/// either way. What Redis had received when the hold began runs at once,
/// in time, and its answer waits here: what a SIGSTOP does to a call Redis
/// was running (or had run, its answer not yet written) when it struck,
/// made certain. The gateway gives up on that call and never hears that it
/// ran; what it sends during the hold reaches Redis late, and is fenced.
pub struct AnswerHold {
    addr: std::net::SocketAddr,
    hold: Arc<AtomicBool>,
    /// Set: the next call `trigger` picks starts a hold as it reaches Redis.
    arm: Arc<AtomicBool>,
}

impl AnswerHold {
    pub fn start(redis_port: u16, trigger: fn(&[u8]) -> bool) -> Self {
        use std::io::{Read, Write};
        use std::net::{TcpListener, TcpStream};
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the relay");
        let addr = listener.local_addr().expect("relay address");
        let hold = Arc::new(AtomicBool::new(false));
        let arm = Arc::new(AtomicBool::new(false));
        let (h, a) = (hold.clone(), arm.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(redis) = TcpStream::connect(("127.0.0.1", redis_port)) else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = redis.set_nodelay(true);
                let pipe = |mut from: TcpStream,
                            mut to: TcpStream,
                            h: Arc<AtomicBool>,
                            a: Option<Arc<AtomicBool>>| {
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = match from.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            let trigger = a.as_ref().is_some_and(|a| {
                                a.load(Ordering::Acquire)
                                    && trigger(&buf[..n])
                                    && a.swap(false, Ordering::AcqRel)
                            });
                            if trigger {
                                h.store(true, Ordering::Release);
                            }
                            while !trigger && h.load(Ordering::Acquire) {
                                std::thread::sleep(Duration::from_millis(1));
                            }
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                };
                pipe(
                    client.try_clone().unwrap(),
                    redis.try_clone().unwrap(),
                    h.clone(),
                    Some(a.clone()),
                );
                pipe(redis, client, h.clone(), None);
            }
        });
        AnswerHold { addr, hold, arm }
    }

    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Holds the next call the trigger picks (`what`, for the wait's
    /// message) for 1.5 s after Redis received it.
    pub fn hold_next(&self, what: &str) {
        self.arm.store(true, Ordering::Release);
        wait_for(&format!("{what} to hold"), Duration::from_secs(5), || {
            self.hold.load(Ordering::Acquire).then_some(())
        });
        std::thread::sleep(Duration::from_millis(1500));
        self.hold.store(false, Ordering::Release);
    }
}
