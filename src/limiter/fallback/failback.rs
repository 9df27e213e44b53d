//! Failback: the probes that bring traffic back to Redis, and the charge of
//! what this replica admitted on its fallback (its debts) before they do.

use super::*;

impl Fallback {
    /// One probe round; closes the breaker after enough good probes, once
    /// what was admitted locally has been charged to the shared buckets.
    pub async fn probe_once(&self) {
        let Some(redis) = &self.redis else { return };
        if self.redis_up.load(Ordering::Relaxed) {
            return;
        }
        let probed = redis.probe(&self.probe_key).await;
        metrics::redis_probe(probed.is_ok());
        match probed {
            Ok(()) => {
                let n = self.good_probes.fetch_add(1, Ordering::AcqRel) + 1;
                if n < PROBES_TO_FAIL_BACK {
                    return;
                }
                if let Err(e) = self.settle_debts(redis).await {
                    let tries = self.failed_settles.fetch_add(1, Ordering::AcqRel) + 1;
                    if tries < SETTLE_TRIES {
                        self.good_probes.store(0, Ordering::Relaxed);
                        self.note_failure(e);
                        return;
                    }
                    tracing::error!(error = %self.redact(&e.to_string()), tries, "limiter: cannot charge what was admitted locally; failing back anyway, the charge is retried each second");
                }
                self.failed_settles.store(0, Ordering::Relaxed);
                redis.renew_request_connection();
                if !self.redis_up.swap(true, Ordering::AcqRel) {
                    let on_fallback = self.fallback_since.lock().take().map(|t| t.elapsed());
                    tracing::info!(
                        on_fallback_ms = on_fallback.map_or(0, |d| d.as_millis() as u64),
                        "limiter: redis healthy again, failing back"
                    );
                    // Perhaps another Redis, or the same one restarted.
                    self.persistence_due.store(true, Ordering::Release);
                    metrics::fallback_transition(FallbackState::Redis.as_str());
                }
                // Admissions decided locally while the first charge ran.
                self.settle_later(redis).await;
                self.heartbeat().await;
            }
            Err(e) => {
                self.good_probes.store(0, Ordering::Relaxed);
                self.note_failure(e);
            }
        }
        self.still_on_fallback();
    }

    /// While on the fallback: a WARN line every `LOUD_EVERY` with how long
    /// and the last probe's error (`/readyz` and `/metrics` say it too).
    pub(super) fn still_on_fallback(&self) {
        if self.redis_up.load(Ordering::Acquire) {
            return;
        }
        let Some(since) = *self.fallback_since.lock() else {
            return;
        };
        let mut logged = self.fallback_logged.lock();
        if logged.is_some_and(|t| t.elapsed() < LOUD_EVERY) {
            return;
        }
        *logged = Some(Instant::now());
        let last = self.last_error.lock().clone();
        tracing::warn!(
            on_fallback_secs = since.elapsed().as_secs(),
            last_probe_error = %last.map_or_else(|| "none".to_string(), |e| self.redact(&e.to_string())),
            on_redis_failure = ?self.on_failure,
            "limiter: still on the fallback, redis not deciding"
        );
    }

    /// Charges the ledger to Redis; what a failure leaves uncharged is put
    /// back for the next attempt (merged with what was recorded since).
    pub(super) async fn settle_debts(&self, redis: &RedisBackend) -> Result<(), LimiterError> {
        self.settle_doubts(redis).await?;
        let mut debts = self.ledger.take();
        if debts.is_empty() {
            return Ok(());
        }
        match redis.charge(&debts, &self.replica_id).await {
            Ok(written) => {
                tracing::info!(
                    buckets = debts.len(),
                    written,
                    "limiter: charged what was admitted locally to the shared buckets"
                );
                metrics::debts_charged(debts.len());
                Ok(())
            }
            Err((charged, e)) => {
                metrics::debts_charged(charged);
                self.ledger.restore(debts.split_off(charged));
                Err(e)
            }
        }
    }

    /// Admissions whose Redis call failed after it may have run: each
    /// call's marker says whether it ran and what it admitted, and what
    /// Redis charged then is taken off the debts, so a request is charged
    /// once. A call that did not run is voided: it never will.
    async fn settle_doubts(&self, redis: &RedisBackend) -> Result<(), LimiterError> {
        let doubts = self.ledger.take_doubts();
        if doubts.is_empty() {
            return Ok(());
        }
        let mut said = std::collections::HashMap::new();
        for marker in Ledger::markers(&doubts) {
            match redis.what_ran(&marker).await {
                Ok(flags) => {
                    metrics::lost_answer(flags.is_some());
                    said.insert(marker, flags);
                }
                Err(e) => {
                    self.ledger.restore_doubts(doubts);
                    return Err(e);
                }
            }
        }
        let mut once = 0;
        for d in &doubts {
            let flags = said.get(&d.sent.marker).and_then(Option::as_deref);
            if let Some(&f @ (b'1' | b'2')) = flags.and_then(|f| f.as_bytes().get(d.sent.index)) {
                self.ledger.settle(d, f);
                once += 1;
            }
        }
        tracing::info!(
            calls = said.len(),
            ran = said.values().filter(|f| f.is_some()).count(),
            requests = doubts.len(),
            charged_by_redis = once,
            "limiter: calls whose answers were lost, settled: what they admitted in redis is not charged again"
        );
        Ok(())
    }

    /// A charge while Redis decides (stragglers after failback, or a charge
    /// that failed before it): a failure is logged and retried next second.
    pub(super) async fn settle_later(&self, redis: &RedisBackend) {
        if self.ledger.is_empty() {
            return;
        }
        if let Err(e) = self.settle_debts(redis).await {
            metrics::redis_error(e.reason());
            tracing::warn!(error = %self.redact(&e.to_string()), "limiter: charging what was admitted locally failed; retrying in a second");
        }
    }
}
