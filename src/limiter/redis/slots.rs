//! Which Redis Cluster master serves each hash slot, as `CLUSTER SLOTS`
//! last said: what lets one call decide every bucket of a batch that one
//! node holds, whatever their slots. Only a hint: a call sent on a stale map
//! is refused by Redis before it writes anything (a key the node does not
//! serve), and the batch is then decided slot by slot.

use std::time::{Duration, Instant};

/// Hash slots in a Redis Cluster.
pub const SLOTS: usize = 16384;

/// How long a map is trusted before it is read again (a resharding is
/// noticed at the latest this late, or at the first call it misroutes).
pub const MAX_AGE: Duration = Duration::from_secs(1);

pub struct SlotMap {
    /// The serving master's index per slot; `u16::MAX` where none serves.
    owner: Vec<u16>,
    pub read_at: Instant,
}

impl SlotMap {
    /// From a `CLUSTER SLOTS` reply: `[[start, end, [host, port, ...], replicas...], ...]`.
    pub fn from_reply(reply: &redis::Value, read_at: Instant) -> Option<SlotMap> {
        use redis::Value;
        let Value::Array(ranges) = reply else {
            return None;
        };
        let mut owner = vec![u16::MAX; SLOTS];
        let mut masters: Vec<(Vec<u8>, i64)> = Vec::new();
        for range in ranges {
            let Value::Array(fields) = range else {
                return None;
            };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return None;
            };
            let host = match master.first() {
                Some(Value::BulkString(h)) => h.clone(),
                Some(Value::SimpleString(h)) => h.clone().into_bytes(),
                _ => return None,
            };
            let Some(Value::Int(port)) = master.get(1) else {
                return None;
            };
            let node = (host, *port);
            let index = match masters.iter().position(|m| *m == node) {
                Some(i) => i,
                None => {
                    masters.push(node);
                    masters.len() - 1
                }
            };
            let (start, end) = (*start as usize, *end as usize);
            if start > end || end >= SLOTS {
                return None;
            }
            owner[start..=end].fill(index as u16);
        }
        Some(SlotMap { owner, read_at })
    }

    /// The master serving `slot`, if the map names one.
    pub fn node(&self, slot: u16) -> Option<u16> {
        self.owner
            .get(slot as usize)
            .copied()
            .filter(|&n| n != u16::MAX)
    }

    pub fn fresh(&self, now: Instant) -> bool {
        now.duration_since(self.read_at) < MAX_AGE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::Value;

    fn range(start: i64, end: i64, port: i64) -> Value {
        Value::Array(vec![
            Value::Int(start),
            Value::Int(end),
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ]),
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(port + 100),
            ]),
        ])
    }

    #[test]
    fn slots_map_to_their_masters() {
        let reply = Value::Array(vec![
            range(0, 5460, 7000),
            range(5461, 10922, 7001),
            range(10923, 16000, 7002),
            // A master serving two ranges is one node.
            range(16001, 16383, 7000),
        ]);
        let m = SlotMap::from_reply(&reply, Instant::now()).expect("parsed");
        assert_eq!(m.node(0), Some(0));
        assert_eq!(m.node(5460), Some(0));
        assert_eq!(m.node(5461), Some(1));
        assert_eq!(m.node(16000), Some(2));
        assert_eq!(m.node(16383), Some(0));
        let partial = Value::Array(vec![range(0, 100, 7000)]);
        let m = SlotMap::from_reply(&partial, Instant::now()).expect("parsed");
        assert_eq!(m.node(101), None, "a slot nobody serves");
        assert!(
            SlotMap::from_reply(&Value::Array(vec![range(5, 3, 7000)]), Instant::now()).is_none()
        );
        assert!(SlotMap::from_reply(&Value::Nil, Instant::now()).is_none());
    }
}
