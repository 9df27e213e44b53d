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

/// CRC16/XMODEM, a byte at a time: a key's slot is computed for every tier
/// of every request in cluster mode, so not a bit at a time.
const CRC16: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// Redis Cluster's hash slot of a key (CRC16/XMODEM mod 16384), honouring
/// `{hash tags}` as Redis does: the first `{...}` with something inside.
pub fn slot(key: &str) -> u16 {
    let b = key.as_bytes();
    let tagged = b.iter().position(|&c| c == b'{').and_then(|open| {
        let close = b[open + 1..].iter().position(|&c| c == b'}')?;
        (close > 0).then(|| &b[open + 1..open + 1 + close])
    });
    let crc = tagged.unwrap_or(b).iter().fold(0u16, |crc, &byte| {
        (crc << 8) ^ CRC16[((crc >> 8) as u8 ^ byte) as usize]
    });
    crc % SLOTS as u16
}

pub struct SlotMap {
    /// The serving master's index per slot; `u16::MAX` where none serves.
    owner: Vec<u16>,
    /// Each master's `host:port`, by index (`None`: the reply named no
    /// host, meaning the node asked; reached through the cluster client).
    addresses: Vec<Option<String>>,
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
        let addresses = masters
            .into_iter()
            .map(|(host, port)| {
                let host = String::from_utf8(host)
                    .ok()
                    .filter(|h| !h.is_empty() && h != "?")?;
                // An IPv6 host is bracketed in a URL.
                Some(match host.contains(':') {
                    true => format!("[{host}]:{port}"),
                    false => format!("{host}:{port}"),
                })
            })
            .collect();
        Some(SlotMap {
            owner,
            addresses,
            read_at,
        })
    }

    /// Where master `node` listens, as `host:port`.
    pub fn address(&self, node: u16) -> Option<&str> {
        self.addresses.get(node as usize)?.as_deref()
    }

    /// Every master's address the map names.
    pub fn addresses(&self) -> impl Iterator<Item = &str> {
        self.addresses.iter().filter_map(|a| a.as_deref())
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
        assert_eq!(m.address(1), Some("127.0.0.1:7001"));
        assert_eq!(m.addresses().count(), 3);
        let partial = Value::Array(vec![range(0, 100, 7000)]);
        let m = SlotMap::from_reply(&partial, Instant::now()).expect("parsed");
        assert_eq!(m.node(101), None, "a slot nobody serves");
        assert!(
            SlotMap::from_reply(&Value::Array(vec![range(5, 3, 7000)]), Instant::now()).is_none()
        );
        assert!(SlotMap::from_reply(&Value::Nil, Instant::now()).is_none());
    }
}
