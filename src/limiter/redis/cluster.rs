//! Cluster mode's routing: a batch split by the master serving each bucket
//! (the slot map, read again off the request path), one call per master;
//! a refused call (MOVED, ASK, a slot on the move) decided again slot by
//! slot; the shares a rejected request took on other masters refunded.

use super::*;

impl Inner {
    /// Cluster mode: a batch split by the node that serves each bucket
    /// (when the slot map is known: each call then goes on that node's own
    /// connection) and otherwise by hash slot (through the cluster client).
    /// Each group's share of every request (its tiers there) goes in one
    /// call, all groups' calls at once (one round trip of wall time); within a call
    /// the shares are decided in order, all or nothing, as `limiter.lua`
    /// does for standalone. A request is admitted when every share admits;
    /// otherwise the shares that admitted are refunded (`refund.lua`), so a
    /// rejected request charges no tier. Between the two round trips the
    /// reserved quota is held: later requests of the batch can see less
    /// quota, never more. A refund that fails leaves the client charged. On
    /// any failed call the whole batch fails, its admitted shares refunded;
    /// when a node refused a call before running it (a stale map, a slot on
    /// the move), the batch is decided again: slot by slot, each call
    /// following its own redirection, then through the cluster client, at
    /// most `MISPLACED_RETRIES` times.
    pub(super) async fn decide_clustered(
        &self,
        conn: &Conn,
        requests: &[&[Check]],
        asks: &Asks,
    ) -> Result<Vec<Verdict>, LimiterError> {
        self.refresh_slot_map(conn, false);
        // A map kept past twice its age (no batch read it again: the
        // breaker was open, or traffic stopped) is not trusted.
        let mut map = self
            .slot_map
            .load_full()
            .filter(|m| m.read_at.elapsed() < 2 * slots::MAX_AGE);
        let mut attempt = 0;
        loop {
            // By master first; once refused, slot by slot (a master's
            // connection still, each call following its own redirection);
            // then through the cluster client.
            let by_slot = attempt > 0;
            // Leases are asked for once: a call that ran granted its share
            // (applied as it answered), and a batch decided again asks for
            // none.
            let none = Asks::default();
            let asks = if attempt == 0 { asks } else { &none };
            let result = self
                .decide_grouped(conn, requests, asks, map.as_deref(), by_slot)
                .await;
            match result {
                // Nothing ran, and the batch's other shares were refunded:
                // decide again. At the instant a slot changes hands even the
                // cluster client can be refused; a few ms later it is settled.
                Err(e) if misplaced(&e) && attempt < MISPLACED_RETRIES => {
                    self.refresh_slot_map(conn, true);
                    if attempt > 0 {
                        map = None;
                        tokio::time::sleep(Duration::from_millis(2 * attempt as u64)).await;
                    }
                    attempt += 1;
                }
                Err(e) => {
                    // A master that failed (killed, failed over) may no
                    // longer be one: until the map is read anew, batches go
                    // through the cluster client.
                    if map.is_some() && !misplaced(&e) {
                        self.forget_slot_map();
                    }
                    self.refresh_slot_map(conn, true);
                    return Err(e);
                }
                ok => return ok,
            }
        }
    }

    /// Drops the slot map (batches go through the cluster client until it
    /// is read again); a read begun before this does not store it back.
    pub(super) fn forget_slot_map(&self) {
        self.slot_map_epoch
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.slot_map.store(None);
    }

    /// Reads the slot map again when it is missing or old, in a task of
    /// its own (never on a request's path); `force`: now.
    pub(super) fn refresh_slot_map(&self, conn: &Conn, force: bool) {
        use std::sync::atomic::Ordering;
        let now = Instant::now();
        let fresh = self.slot_map.load().as_ref().is_some_and(|m| m.fresh(now));
        if (fresh && !force) || self.slot_map_reading.swap(true, Ordering::AcqRel) {
            return;
        }
        let (map, reading, epoch, node_conns, mut conn) = (
            self.slot_map.clone(),
            self.slot_map_reading.clone(),
            self.slot_map_epoch.clone(),
            self.node_conns.clone(),
            conn.clone(),
        );
        let began = epoch.load(Ordering::Acquire);
        tokio::spawn(async move {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SLOTS");
            let reply: redis::RedisResult<redis::Value> = query(&mut conn, &cmd).await;
            let read = reply.ok().and_then(|v| SlotMap::from_reply(&v, now));
            if let Some(m) = &read {
                // A master gone from the map (failed over, removed) keeps no
                // connection.
                let names: Vec<&str> = m.addresses().collect();
                node_conns
                    .lock()
                    .retain(|addr, _| names.contains(&addr.as_str()));
            }
            if epoch.load(Ordering::Acquire) == began {
                map.store(read.map(Arc::new));
            }
            reading.store(false, Ordering::Release);
        });
    }

    /// One round of `decide_clustered`: grouped by node with `map`, else by slot.
    pub(super) async fn decide_grouped(
        &self,
        conn: &Conn,
        requests: &[&[Check]],
        asks: &Asks,
        map: Option<&SlotMap>,
        by_slot: bool,
    ) -> Result<Vec<Verdict>, LimiterError> {
        let sent = Instant::now();
        // A group: a node (or, by slot or unmapped, a slot): its first slot,
        // whether it spans several, and its shares.
        let group_of = |sl: u16| match map.and_then(|m| m.node(sl)).filter(|_| !by_slot) {
            Some(node) => node as u32,
            None => 0x1_0000 | sl as u32,
        };
        let mut groups: Vec<(u32, u16, bool, Vec<Share>)> = Vec::new();
        // The group of a bucket's slot (made when new), marked as spanning
        // slots when it holds another.
        let group = |groups: &mut Vec<(u32, u16, bool, Vec<Share>)>, key: &str| {
            let sl = slot(key);
            let id = group_of(sl);
            let g = match groups.iter().position(|(x, ..)| *x == id) {
                Some(g) => g,
                None => {
                    groups.push((id, sl, false, Vec::new()));
                    groups.len() - 1
                }
            };
            groups[g].2 |= groups[g].1 != sl;
            g
        };
        // Per request and tier: (group, share, position in the share).
        let mut placed: Vec<Vec<(usize, usize, usize)>> = Vec::with_capacity(requests.len());
        for (r, checks) in requests.iter().enumerate() {
            let mut at = Vec::with_capacity(checks.len());
            for c in checks.iter() {
                let g = group(&mut groups, &c.key);
                let shares = &mut groups[g].3;
                if shares.last().is_none_or(|(q, _)| *q != r) {
                    shares.push((r, Vec::new()));
                }
                let share = shares.len() - 1;
                shares[share].1.push(c.clone());
                at.push((g, share, shares[share].1.len() - 1));
            }
            placed.push(at);
        }
        // Each lease request goes with its bucket's group (a group of its
        // own when no request of the batch names that node or slot).
        let ask_groups: Vec<usize> = asks
            .asks
            .iter()
            .map(|a| group(&mut groups, &a.check.key))
            .collect();
        let mut group_asks: Vec<Asks> = (0..groups.len())
            .map(|_| Asks {
                asks: Vec::new(),
                ..asks.clone()
            })
            .collect();
        for (a, g) in asks.asks.iter().zip(ask_groups) {
            group_asks[g].asks.push(a.clone());
        }
        // Each group's call goes on its master's own connection when the map
        // says where the master is, else through the cluster client; all at
        // once, from this task.
        let conns: Vec<Result<Conn, LimiterError>> = groups
            .iter()
            .map(
                |(_, first, ..)| match map.and_then(|m| m.address(m.node(*first)?)) {
                    Some(addr) => self.node_connection(addr),
                    None => Ok(conn.clone()),
                },
            )
            .collect();
        let calls =
            groups
                .iter()
                .zip(&conns)
                .zip(&group_asks)
                .map(|(((_, _, spans, shares), c), asks)| {
                    let conn = c.clone();
                    async move {
                        let parts: Vec<&[Check]> =
                            shares.iter().map(|(_, c)| c.as_slice()).collect();
                        // Settled however this call ends (its future may be
                        // dropped when the batch is abandoned).
                        let settle = self.leases.as_ref().map(|l| l.settle(asks));
                        let mut conn = conn?;
                        let result =
                            match run_script(self, &mut conn, &parts, asks, *spans, false, None)
                                .await
                            {
                                // A master's own connection redirected: follow it
                                // once, as the cluster client would (ASK: on the
                                // node importing the slot, this call only).
                                Err(LimiterError::Misplaced(
                                    code @ ("ASK" | "MOVED"),
                                    Some(to),
                                )) if matches!(conn, Conn::Single(_)) => {
                                    let mut there = self.node_connection(&to)?;
                                    let asking = code == "ASK";
                                    run_script(self, &mut there, &parts, asks, *spans, asking, None)
                                        .await
                                }
                                other => other,
                            };
                        // A call that ran took its grants, whatever the batch's
                        // other calls did.
                        match (result, settle) {
                            (Ok((mut verdicts, grants, now_us)), Some(settle)) => {
                                settle.granted(&grants, sent, now_us);
                                debit(&parts, &mut verdicts, asks, &grants);
                                Ok(verdicts)
                            }
                            (Ok((verdicts, ..)), None) => Ok(verdicts),
                            (Err(e), settle) => {
                                if let Some(settle) = settle {
                                    settle.failed(e.may_have_run());
                                }
                                Err(e)
                            }
                        }
                    }
                });
        let results = futures::future::join_all(calls).await;
        let mut answers: Vec<Option<Vec<Verdict>>> = Vec::with_capacity(results.len());
        // The error the batch fails with: a misplaced call's only if every
        // failed call was misplaced (nothing written: the batch may be
        // decided again); any other (a timeout: the call may have run) wins.
        let mut failed: Option<LimiterError> = None;
        for result in results {
            match result {
                Ok(v) => answers.push(Some(v)),
                Err(e) => {
                    answers.push(None);
                    if failed.as_ref().is_none_or(misplaced) {
                        failed = Some(e);
                    }
                }
            }
        }
        // A share admitted as a whole took its admitting tiers' tokens.
        let share_admitted = |g: usize, share: usize| {
            answers[g].as_ref().is_some_and(|v| {
                let checks = &groups[g].3[share].1;
                v[share].admitted(checks)
            })
        };
        let mut verdicts = Vec::with_capacity(requests.len());
        let mut refunds = Vec::new();
        for (r, checks) in requests.iter().enumerate() {
            let decisions: Option<Vec<Decision>> = placed[r]
                .iter()
                .map(|&(g, share, i)| Some(answers[g].as_ref()?[share].decisions[i]))
                .collect();
            let admitted = failed.is_none()
                && decisions
                    .as_ref()
                    .is_some_and(|d| checks.iter().zip(d).all(|(c, d)| d.allowed || c.shadow));
            if !admitted {
                // Give back what its admitted shares took, tier by tier (a
                // share is this request's tiers on one node).
                for (k, &(g, share, i)) in placed[r].iter().enumerate() {
                    if !share_admitted(g, share) {
                        continue;
                    }
                    let v = &answers[g].as_ref().expect("admitted share")[share];
                    let d = &v.decisions[i];
                    if d.allowed {
                        // The node that charged it (its call answered, so
                        // its connection was made).
                        let node = conns[g].as_ref().unwrap_or(conn);
                        let refund = self.refund_one(node, &checks[k], v.now_us, d.remaining);
                        refunds.push((r, k, refund));
                    }
                }
            }
            if let Some(decisions) = decisions {
                let now_us = placed[r]
                    .iter()
                    .filter_map(|&(g, share, _)| Some(answers[g].as_ref()?[share].now_us))
                    .max()
                    .unwrap_or(0);
                verdicts.push(Verdict { decisions, now_us });
            }
        }
        for (r, k, refund) in refunds {
            // A refund made gives the admission back: what this replica is
            // told the bucket holds (its leases start from it) must not count
            // it as spent. (`verdicts` holds every request when no call failed.)
            if refund.await.unwrap_or(false) && failed.is_none() {
                let c = &requests[r][k];
                let d = &mut verdicts[r].decisions[k];
                *d = d.refunded(c.cost, &c.algorithm);
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(verdicts),
        }
    }

    /// Gives back one tier's admission (`refund.lua`), in a task of its own:
    /// on the master's own connection that charged it (never sent twice),
    /// or, when the charge went through the cluster client or the bucket's
    /// slot has moved since (MOVED, ASK), through the refunds' cluster
    /// connection, which never retries. A refund not made leaves the client
    /// charged: less admitted, never more.
    pub(super) fn refund_one(
        &self,
        node: &Conn,
        c: &Check,
        now_us: i64,
        remaining: u64,
    ) -> tokio::task::JoinHandle<bool> {
        let direct = match node {
            Conn::Single(c) => Some(c.clone()),
            Conn::Cluster(_) => None,
        };
        let refunder = self.refund_conn.load().as_deref().cloned();
        let refund = self.refund.clone();
        let (kind, p1, p2) = script_args(&c.algorithm);
        let (key, cost) = (c.key.clone(), c.cost);
        tokio::spawn(async move {
            let mut inv = refund.prepare_invoke();
            inv.key(key)
                .arg(kind)
                .arg(p1)
                .arg(p2)
                .arg(now_us)
                .arg(remaining);
            inv.arg(cost);
            let moved = |e: &redis::RedisError| matches!(e.code(), Some("MOVED" | "ASK"));
            let mut r: Option<Result<i64, redis::RedisError>> = None;
            if let Some(mut c) = direct {
                r = Some(inv.invoke_async(&mut c).await);
            }
            if r.as_ref().is_none_or(|r| r.as_ref().is_err_and(moved)) {
                if let Some(mut c) = refunder {
                    r = Some(inv.invoke_async(&mut c).await);
                }
            }
            match r {
                Some(Ok(given)) => given == 1,
                // The error's class only: its text could name the server.
                Some(Err(e)) => {
                    tracing::warn!(error_kind = ?e.kind(), code = e.code().unwrap_or("-"), "limiter: refund failed; the client stays charged");
                    false
                }
                None => {
                    tracing::warn!("limiter: no connection for a refund; the client stays charged");
                    false
                }
            }
        })
    }
}

/// A request's tiers on one node (or in one slot): (the request's index in
/// its batch, the tiers).
pub(super) type Share = (usize, Vec<Check>);

/// Whether a cluster call failed because it reached a node that does not
/// serve one of its keys (a stale slot map, a slot on the move): nothing was
/// written, and the batch can be decided again slot by slot.
pub(super) fn misplaced(e: &LimiterError) -> bool {
    match e {
        LimiterError::CrossSlot | LimiterError::Misplaced(..) => true,
        LimiterError::Redis(text) => ["non local key", "MOVED", "TRYAGAIN"]
            .iter()
            .any(|m| text.contains(m)),
        _ => false,
    }
}
