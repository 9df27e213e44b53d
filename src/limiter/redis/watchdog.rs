//! Budgets and health: the failback probe (connect, scripts, a write) and
//! the replacement of a connection that stayed silent; a call's wait for its
//! answer, with the watchdog told when it passes its budget (`answer`); the
//! probe's own calls bounded by their budget (`by`).

use super::*;

impl Inner {
    /// Checks that Redis takes writes and has the scripts (loading them if
    /// not): what the failback probe asks before trusting Redis again. The
    /// write catches what a PING would not: a full Redis (OOM) and a demoted
    /// master (READONLY). In cluster mode the cluster must also say it is ok.
    pub async fn probe(&self, probe_key: &str) -> Result<(), LimiterError> {
        let work = async {
            self.ensure_connected().await?;
            let conn = self.probe_connection()?;
            match conn {
                Conn::Single(mut c) => self.probe_on(&mut c, probe_key).await,
                Conn::Cluster(mut c) => {
                    let info: String = redis::cmd("CLUSTER")
                        .arg("INFO")
                        .query_async(&mut c)
                        .await
                        .map_err(redis_err)?;
                    if !info.contains("cluster_state:ok") {
                        return Err(LimiterError::Redis("cluster_state is not ok".into()));
                    }
                    self.probe_on(&mut c, probe_key).await
                }
            }
        };
        let result = match tokio::time::timeout(self.upkeep_budget(), work).await {
            Ok(r) => r,
            Err(_) => Err(LimiterError::Timeout(self.budget.as_millis() as u64)),
        };
        if let Err(e) = &result {
            // A connection that stayed silent is not probed again: the next
            // probe opens a new one. A connection can stay silent for good
            // after a partition heals (a NAT or firewall that forgot its
            // flow), and a timeout does not make redis-rs replace it;
            // probing on it would keep this replica on its fallback while
            // Redis is healthy.
            if e.is_silence() {
                self.forget_probe_connection();
            }
        }
        result
    }

    /// Drops the probe's connection; the next probe makes a new one (a
    /// sentinel's master is asked for again, a cluster's map read again).
    pub(super) fn forget_probe_connection(&self) {
        self.probe_single.store(None);
        if !matches!(&**self.topology.load(), Topology::Standalone(_)) {
            self.connected.store(None);
        }
    }

    pub(super) async fn probe_on(
        &self,
        c: &mut impl redis::aio::ConnectionLike,
        probe_key: &str,
    ) -> Result<(), LimiterError> {
        for script in [&self.script, &self.refund] {
            let exists: Vec<bool> = redis::cmd("SCRIPT")
                .arg("EXISTS")
                .arg(script.get_hash())
                .query_async(c)
                .await
                .map_err(redis_err)?;
            if !exists.first().copied().unwrap_or(false) {
                script.load_async(c).await.map_err(redis_err)?;
            }
        }
        redis::cmd("SET")
            .arg(probe_key)
            .arg(1)
            .arg("PX")
            .arg(1000)
            .query_async::<()>(c)
            .await
            .map_err(redis_err)
    }

    /// Waits for a call sent now: within the budget, its answer; past it the
    /// watchdog is told, and the call is awaited until it answers, the
    /// breaker opens (`abandon`) or `max_wait` has passed.
    pub(super) async fn answer<T>(
        &self,
        work: impl std::future::Future<Output = Result<T, LimiterError>>,
        abandon: &mut tokio::sync::watch::Receiver<u64>,
    ) -> Result<T, LimiterError> {
        tokio::pin!(work);
        let sent = Instant::now();
        if let Ok(r) = tokio::time::timeout(self.budget, &mut work).await {
            return r;
        }
        // Late: the watchdog asks Redis again every budget while it stays so
        // (a Redis that stalls right after answering one PING is still caught).
        let give_up = tokio::time::sleep_until((sent + self.max_wait).into());
        tokio::pin!(give_up);
        loop {
            self.late.notify_one();
            tokio::select! {
                r = &mut work => return r,
                _ = abandon.changed() => return Err(LimiterError::Abandoned),
                _ = &mut give_up => {
                    return Err(LimiterError::Timeout(self.max_wait.as_millis() as u64));
                }
                _ = tokio::time::sleep(self.budget) => {}
            }
        }
    }

    /// `work`'s result, or the budget's timeout error once `until` has passed.
    pub(super) async fn by<T>(
        &self,
        until: Instant,
        work: impl std::future::Future<Output = Result<T, LimiterError>>,
    ) -> Result<T, LimiterError> {
        match tokio::time::timeout_at(until.into(), work).await {
            Ok(r) => r,
            Err(_) => Err(LimiterError::Timeout(self.budget.as_millis() as u64)),
        }
    }
}
