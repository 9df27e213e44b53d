//! `limiter.lua`'s calling convention: a batch of requests turned into one
//! call's KEYS and ARGV (each bucket named once with its rule, requests
//! sharing a shape), sent with EVALSHA (loaded on NOSCRIPT), and the reply
//! read back into one verdict per request.

use std::sync::atomic::Ordering;

use super::*;
use crate::clock::SystemClock;

/// Fences a call off from the time after its caller may have given up on
/// it: the call carries a deadline on Redis's clock, past which
/// `limiter.lua` writes nothing (`LimiterError::Late`). A Redis that stalls
/// then runs the calls queued meanwhile; the gateway decided their requests
/// on its fallback and charges those at failback, so a late call that also
/// charged them would charge them twice (a quota would bill requests nobody
/// served). Redis's clock is read off each answer (`learn`), so no clock
/// needs to agree with another.
pub(super) struct Fence {
    /// Redis's time less this host's, as last seen (`i64::MIN`: not yet).
    offset_us: std::sync::atomic::AtomicI64,
    /// How long after it is sent a call may still write: twice the budget,
    /// the soonest its caller can have been abandoned (a late call, then
    /// the watchdog's PING), so a Redis merely slow is not fenced off.
    after_us: i64,
}

impl Fence {
    pub(super) fn new(budget: Duration) -> Self {
        Fence {
            offset_us: std::sync::atomic::AtomicI64::new(i64::MIN),
            after_us: 2 * budget.as_micros() as i64,
        }
    }

    fn deadline(&self) -> Option<Micros> {
        self.deadline_in(self.after_us)
    }

    /// A deadline `after_us` from now on Redis's clock, once it is known.
    pub(super) fn deadline_in(&self, after_us: i64) -> Option<Micros> {
        let offset = self.offset_us.load(Ordering::Relaxed);
        (offset != i64::MIN).then(|| SystemClock.now_us() + offset + after_us)
    }

    /// An answer stamped `now_us` by Redis arrived: the offset is at least
    /// that (an answer is read after Redis stamped it). The largest seen is
    /// kept, unless the clocks moved by more than a second (a jump).
    fn learn(&self, now_us: Micros) {
        let seen = now_us - SystemClock.now_us();
        let _ = self
            .offset_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                let keep = old != i64::MIN && seen <= old && old - seen < 1_000_000;
                (!keep).then_some(seen)
            });
    }
}

/// One call of limiter.lua over a batch of requests, with lease requests
/// (`asks`, empty when leases are off): EVALSHA, and on NOSCRIPT (after a
/// restart or SCRIPT FLUSH) load the script and send it again. Returns one
/// verdict per request, one grant per ask and Redis's time.
/// `across_slots`: the buckets are in several slots of one cluster node
/// (only one is declared as a key).
pub(super) async fn run_script(
    inner: &Inner,
    conn: &mut Conn,
    requests: &[&[Check]],
    asks: &Asks,
    across_slots: bool,
    asking: bool,
    marker: Option<&str>,
) -> Result<(Vec<Verdict>, Vec<Grant>, Micros), LimiterError> {
    // Each bucket is named once, with its rule's parameters (a bucket's name
    // carries them, so they are the same for every tier naming it); tiers
    // refer to it by index, so the script reads and writes it once. Requests
    // with the same tiers (one client on one route) share a shape, and a
    // request is sent as its shape's index.
    let (script, clock, fence) = (&inner.script, inner.clock.as_ref(), &inner.fence);
    let tiers: usize = requests.iter().map(|r| r.len()).sum();
    let mut buckets: Vec<&Check> = Vec::with_capacity(tiers);
    let mut index: HashMap<&str, i64> = HashMap::with_capacity(tiers);
    // Across slots (one cluster node's), the call is routed by the first
    // bucket's slot and declares every bucket of that slot: were that slot
    // on the move and the call sent on with ASK, Redis then refuses it
    // (TRYAGAIN) unless all of them have arrived, where a single declared
    // name would let the others read as empty on the node importing them.
    // The other slots' names are passed as arguments.
    // The asks' buckets come after the requests' (a renewal's may be in no
    // request of the call).
    let all = || {
        requests
            .iter()
            .flat_map(|r| r.iter())
            .chain(asks.asks.iter().map(|a| &a.check))
    };
    let anchor = all().next().filter(|_| across_slots).map(|c| slot(&c.key));
    for c in all() {
        if anchor.is_none_or(|a| slot(&c.key) == a) && !index.contains_key(c.key.as_str()) {
            buckets.push(c);
            index.insert(c.key.as_str(), buckets.len() as i64);
        }
    }
    let declared = buckets.len();
    // Per tier two numbers: the bucket's index (negated for a shadow tier)
    // and the request's cost there.
    let refs: Vec<[i64; 2]> = requests
        .iter()
        .flat_map(|r| r.iter())
        .map(|c| {
            let k = *index.entry(c.key.as_str()).or_insert_with(|| {
                buckets.push(c);
                buckets.len() as i64
            });
            [if c.shadow { -k } else { k }, c.cost as i64]
        })
        .collect();
    for a in &asks.asks {
        index.entry(a.check.key.as_str()).or_insert_with(|| {
            buckets.push(&a.check);
            buckets.len() as i64
        });
    }
    let mut shapes: Vec<&[[i64; 2]]> = Vec::new();
    let mut shape_of: HashMap<&[[i64; 2]], usize> = HashMap::new();
    let mut rest = refs.as_slice();
    let request_shapes: Vec<usize> = requests
        .iter()
        .map(|r| {
            let (own, after) = rest.split_at(r.len());
            rest = after;
            *shape_of.entry(own).or_insert_with(|| {
                shapes.push(own);
                shapes.len()
            })
        })
        .collect();
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash()).arg(declared);
    for c in &buckets[..declared] {
        cmd.arg(c.key.as_str());
    }
    let when = match (clock, fence.deadline()) {
        (Some(clock), _) => clock.now_us().to_string(),
        (None, Some(deadline)) => format!("d{deadline}"),
        (None, None) => String::new(),
    };
    match marker {
        Some(m) => cmd.arg(format!("{when}|{m}")),
        None => cmd.arg(when),
    };
    cmd.arg(requests.len())
        .arg(shapes.len())
        .arg(buckets.len() - declared);
    for c in &buckets[declared..] {
        cmd.arg(c.key.as_str());
    }
    for c in &buckets {
        let (kind, p1, p2) = script_args(&c.algorithm);
        cmd.arg(kind).arg(p1).arg(p2);
    }
    for shape in &shapes {
        cmd.arg(shape.len());
        for [k, cost] in shape.iter() {
            cmd.arg(*k).arg(*cost);
        }
    }
    for q in request_shapes {
        cmd.arg(q);
    }
    // With leases on, the holder goes even with nothing to ask: Redis
    // then never takes the caller's own quota holding back (`lease::reclaim`).
    if !asks.is_empty() || !asks.holder.is_empty() {
        cmd.arg(asks.asks.len())
            .arg(asks.replicas)
            .arg(asks.min)
            .arg(&*asks.holder)
            .arg(asks.hold_us);
        let first_pull = asks.asks.len() - asks.pulls;
        for (i, a) in asks.asks.iter().enumerate() {
            // A top-up asks with a negative want (`limiter.lua`).
            let want = match i >= first_pull {
                true => -(a.want as i64),
                false => a.want as i64,
            };
            cmd.arg(index[a.check.key.as_str()])
                .arg(want)
                .arg(a.ret)
                .arg(a.until)
                .arg(a.spent)
                .arg(a.report);
        }
    }
    let reply: Vec<i64> = match send(conn, &cmd, asking).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            match conn {
                Conn::Single(c) => script.load_async(c).await,
                Conn::Cluster(c) => script.load_async(c).await,
            }
            .map_err(redis_err)?;
            send(conn, &cmd, asking).await
        }
        other => other,
    }
    .map_err(redis_err)?;
    // Two integers per tier, three for a leaky bucket (its delay), three per
    // lease, then `now`.
    let expected = 1
        + 3 * asks.asks.len()
        + requests
            .iter()
            .flat_map(|r| r.iter())
            .map(|c| reply_width(&c.algorithm))
            .sum::<usize>();
    if reply.len() != expected {
        return Err(LimiterError::BadReply(format!(
            "{} integers for {} tiers (expected {})",
            reply.len(),
            tiers,
            expected
        )));
    }
    let now_us = reply[expected - 1];
    if clock.is_none() {
        fence.learn(now_us);
    }
    let grants = reply[expected - 1 - 3 * asks.asks.len()..expected - 1]
        .chunks(3)
        .map(|g| Grant {
            tokens: g[0].max(0) as u64,
            until: g[1],
            taken_back: g[2].max(0) as u64,
            told: g[2] < 0,
        })
        .collect();
    let mut at = 0;
    let verdicts = requests
        .iter()
        .map(|r| Verdict {
            decisions: r
                .iter()
                .map(|c| {
                    let w = reply_width(&c.algorithm);
                    let d = decision(c, &reply[at..at + w]);
                    at += w;
                    d
                })
                .collect(),
            now_us,
        })
        .collect();
    Ok((verdicts, grants, now_us))
}

/// `cmd`, after `ASKING` when `asking` (sent together, so nothing else on
/// the multiplexed connection comes between them).
pub(super) async fn send(
    conn: &mut Conn,
    cmd: &redis::Cmd,
    asking: bool,
) -> redis::RedisResult<Vec<i64>> {
    if !asking {
        return query(conn, cmd).await;
    }
    let mut pipe = redis::pipe();
    pipe.cmd("ASKING").ignore().add_command(cmd.clone());
    let (reply,): (Vec<i64>,) = match conn {
        Conn::Single(c) => pipe.query_async(c).await?,
        Conn::Cluster(c) => pipe.query_async(c).await?,
    };
    Ok(reply)
}

pub(super) async fn query<T: redis::FromRedisValue>(
    conn: &mut Conn,
    cmd: &redis::Cmd,
) -> redis::RedisResult<T> {
    match conn {
        Conn::Single(c) => cmd.query_async(c).await,
        Conn::Cluster(c) => cmd.query_async(c).await,
    }
}

/// `inv` on `conn`, as `query` sends a command.
pub(super) async fn invoke<T: redis::FromRedisValue>(
    conn: &mut Conn,
    inv: &redis::ScriptInvocation<'_>,
) -> Result<T, LimiterError> {
    match conn {
        Conn::Single(c) => inv.invoke_async(c).await,
        Conn::Cluster(c) => inv.invoke_async(c).await,
    }
    .map_err(redis_err)
}

/// The script's numeric code for an algorithm and its two parameters, written
/// so Lua's `tonumber` reads back exactly the f64 Rust holds.
pub(super) fn script_args(alg: &Algorithm) -> (u8, String, String) {
    match *alg {
        Algorithm::TokenBucket {
            capacity,
            refill_per_sec,
        } => (1, capacity.to_string(), format!("{refill_per_sec:?}")),
        Algorithm::LeakyBucket {
            rate_per_sec,
            max_delay_ms,
        } => (2, format!("{rate_per_sec:?}"), max_delay_ms.to_string()),
        Algorithm::FixedWindow { limit, window_secs } => {
            (3, limit.to_string(), window_secs.to_string())
        }
        Algorithm::SlidingWindow { limit, window_secs } => {
            (4, limit.to_string(), window_secs.to_string())
        }
        Algorithm::SlidingLog { limit, window_secs } => {
            (5, limit.to_string(), window_secs.to_string())
        }
        Algorithm::Calendar { limit, end, .. } => (6, limit.to_string(), end.to_string()),
    }
}

/// How many integers limiter.lua returns for a tier of this algorithm.
pub(super) fn reply_width(alg: &Algorithm) -> usize {
    if matches!(alg, Algorithm::LeakyBucket { .. }) {
        3
    } else {
        2
    }
}

/// One tier's integers: remaining when admitted, -1 - remaining when
/// rejected (what the bucket holds, under the request's cost),
/// reset_after_us (when rejected, the retry time), and for a leaky bucket
/// delay_us.
pub(super) fn decision(c: &Check, r: &[i64]) -> Decision {
    let allowed = r[0] >= 0;
    let reset = r[1].max(0) as u64;
    Decision {
        allowed,
        limit: quota(&c.algorithm),
        remaining: if allowed { r[0] } else { -1 - r[0] }.max(0) as u64,
        retry_after_us: if allowed { 0 } else { reset },
        reset_after_us: reset,
        delay_us: r.get(2).map_or(0, |&d| d.max(0) as u64),
    }
}
