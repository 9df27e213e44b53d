--[[ limiter.lua: decide a batch of requests, each over all its tiers, all or
nothing per request, in one call.

The gateway gathers the requests that arrive while its previous call is in
flight and sends them together: one round trip, one TIME, one MGET and one SET
per bucket however many requests of the batch touched it. The requests are
decided one after another, each seeing the state the previous one left, so a
batch decides exactly what the same requests sent one by one at the same
instant would.

KEYS     the distinct buckets of the batch (built by keys.rs; never a secret)
ARGV[1]  now in microseconds since the epoch, or "" to use Redis's own TIME,
         or "d<deadline>": Redis's TIME, and past that deadline (µs on
         Redis's clock) the call writes nothing and fails with "late": its
         caller may have given up on it and decided it elsewhere (a Redis
         that stalled runs the calls queued meanwhile: redis/script.rs)
         Either may be followed by "|<marker>": the call's own name
         (redis/script.rs, `Marks`), under which a call deciding requests
         leaves, for a minute, one character per request: 1 admitted (every
         tier charged), 2 admitted with a shadow tier not charged, 0 refused.
         A replica whose answer was lost reads it at failback, so the
         requests it then also decided on its fallback are charged once.
         A marker already there (a replica that gave up on the call wrote
         "void") makes the call late: it writes nothing.
ARGV[2]  m, the number of requests
ARGV[3]  s, the number of request shapes
ARGV[4]  x, the number of further buckets named in ARGV[5 .. 4 + x]: in
         Redis Cluster, KEYS may hold the names of one slot only, so a call
         deciding the buckets of several slots of one node declares one and
         names the rest here (Redis lets a script without flags reach keys
         of other slots its node serves; a key the node does not serve is an
         error before anything is written, as every bucket is read first)
The buckets are KEYS then those names: bucket k is the kth of them.
then per bucket (in order) three values:
         kind    1 token_bucket   p1 = capacity  p2 = refill per second
                 2 leaky_bucket   p1 = rate/s    p2 = max delay in ms
                 3 fixed_window   p1 = limit     p2 = window seconds
                 4 sliding_window p1 = limit     p2 = window seconds
                 5 sliding_log    p1 = limit     p2 = window seconds
                 6 quota          p1 = limit     p2 = its period's end, in
                                  microseconds since the epoch (the key is
                                  the period's own: algorithms/calendar.rs)
         p1, p2  as above (rates may be fractional)
then per shape: n, its number of tiers, and per tier two values: the index
         k of its bucket in KEYS, negated for a shadow tier (decided and
         reported, never blocking the others), and the request's cost there
         (tokens taken, 1 to the bucket's quota)
then per request: the index of its shape (requests of one client on one
         route share a shape, so a request costs one argument)
then, optionally, leases (leases/): l, the number of them, r, the replicas
         sharing the limit, g0, the smallest lease worth granting, h, the
         holder (the calling replica's random id, [0-9a-z] only) and hold,
         how long after a quota grant Redis takes its unspent tokens back
         itself (µs); per lease six values: k (a token bucket, fixed or
         sliding window, quota), want (tokens asked for; negative: a
         standing share's top-up of -want from its pool, granted from all
         the pool holds, with no fair share and no smallest grant), ret (unspent
         tokens of an expired lease, given back), until (what its grant
         answered: see below), spent (a quota's leased tokens spent since
         the holder last said so; 0 elsewhere) and report (a quota's: the
         number the holder gave this report of spent and ret; 0: none)

A bucket's name carries its rule's parameters (keys.rs), so one bucket has one
set of parameters however many requests of the batch use it.

Returns, for each request and each of its tiers:
  remaining when admitted; when rejected, -1 - what the bucket holds (the
  tokens a request of cost 1 would find: fewer than this one's cost)
  reset_after_us (when rejected: the retry time)
  delay_us, for a leaky bucket only (its wait for its slot)
then per lease: the tokens granted, their `until`, and the tokens taken back
  (-1: its report was counted before, and nothing of it again)
then the `now` that was used.

Leases. Returns are taken back before the requests are decided, grants
made after them. A grant is the smaller of `want` and a fair share (what the
bucket holds now / r), taken exactly as a request of that cost would be; a
share under g0 grants nothing, so the last tokens are decided one request at
a time. A return must leave the bucket exactly as if the unspent tokens had
never been taken; capping it at a full bucket is not enough (a bucket that
refilled while the lease was out, then was partly spent, would get the lease
back on top). So a grant answers `until`: for a window, the window its
tokens count in (a quota: its period's end), taken back only in that window and only from a count that
holds them; for a token bucket, the TAT the bucket would have had without
the grant (its floor): until then no request can have found that bucket
full, so the tokens come back exactly (no further than the floor: those
that would go under it are lost), and the return is refused after it.
A bucket reset while the lease was out is told from its state only when its
count or TAT is lower than the lease left it: a reset bucket spent past that
point may take back a lease from before the reset (docs/design/leases.md).

A quota's leases are also booked in a ledger beside its count: the hash
`{<bucket>}:leases` (the bucket's own slot in a cluster), one field per holder,
"out reclaim_at": tokens granted to it and neither reported spent nor given
back, and when Redis takes them back itself. Each grant adds to `out` and
moves reclaim_at to now + hold; `spent` takes from `out`; a return is taken
back only up to `out` (so never twice). A holder numbers its reports, and
a field of its own keeps the last one counted, "<holder>.t" = "told:forget_at"
(a shape a gateway from before numbers ignores): a report told again (its
call ran, its answer was lost) is not counted twice. It is forgotten a day
after the holder's last grant or report. A holder that dies (SIGKILL) stops
reporting: once reclaim_at passes, its `out` is given back to the count by
the next call that reads the ledger: one that leases the bucket, or one
that might be refused by it (the count plus the batch's cost there is over
the limit). Tokens it spent after its last report are given back with them:
the over-admission a killed replica can cause is what it spent in its last
report interval (docs/design/quota-ledger.md). A holder only cut off reports them when it is
back, and spending beyond what it holds is charged to the count again.
A call never takes its own holder's `out` back (a holder that calls is
alive and reports it), so leases send h even with l = 0.
algorithms/lease.rs is the model.
]]

-- How long a quota period's count is kept past the period's end: at least
-- a minute (calendar.rs's GRACE_US, for a replica whose clock is a little
-- behind), or limiter.quota_retention_days (invoices, `gateway usage`). The
-- gateway builds the script with its own value (redis/mod.rs).
local QUOTA_KEEP_US = 60000000
-- How long a holder's last counted report is remembered after its last
-- grant or report's hold (algorithms/lease.rs's TOLD_KEEP_US).
local TOLD_KEEP_US = 86400000000

-- How long a call's marker (ARGV[1]) says what it admitted, in ms: the
-- gateway's MARK_LIFE_MS (redis/mod.rs).
local MARK_LIFE_MS = 60000

-- Locals: a global lookup per math call adds up at tens of thousands of calls a second.
local floor, ceil, max, fmod, huge = math.floor, math.ceil, math.max, math.fmod, math.huge
local format, match = string.format, string.match
local call, tonum, unpack = redis.call, tonumber, unpack

-- A holder's entry in a quota ledger, {out, reclaim_at, told, forget_at},
-- made empty if it has none.
local function holding(l, h)
  local e = l[h]
  if not e then
    e = {0, 0, 0, 0}
    l[h] = e
  end
  return e
end

local function ceil_us(x)
  if x <= 0 then return 0 end
  return ceil(x)
end

-- Each algorithm takes its bucket's decoded state (nil: empty) and returns
-- admitted, remaining, reset_after (when rejected: the retry time), delay and,
-- when admitted, the new state and its time to live in microseconds.

-- GCRA: token bucket (tau = (capacity-1)*T) and leaky bucket (tau = max delay).
-- The state is the theoretical arrival time of the next request. `limit` is
-- the bucket's size: remaining stays at most limit - n even when T is so
-- small (rates near a million a second) that doubles holding epoch
-- microseconds round. A request costing n is n requests at one instant.
local function gcra(tat, t, tau, limit, shaping, now, n)
  if tat == nil then tat = now end
  local allow_at = tat + (n - 1) * t - tau
  if now >= allow_at then
    local slot = max(tat, now)
    local new_tat = slot + n * t
    local remaining = floor((now + tau - new_tat) / t) + 1
    if remaining > limit - n then remaining = limit - n end
    if remaining < 0 then remaining = 0 end
    local reset = ceil_us(new_tat - now)
    local delay = 0
    if shaping then delay = ceil_us(slot - now) end
    return true, remaining, reset, delay, new_tat, reset
  end
  local retry = ceil_us(ceil(allow_at) - now)
  return false, 0, retry, 0
end

local function window_index(now, w, stored)
  local n = (now - fmod(now, w)) / w
  if stored and stored > n then n = stored end
  return n
end

-- State {window index, count}.
local function fixed_window(s, limit, w, now, cost)
  local win, count = nil, 0
  if s then win, count = s[1], s[2] end
  local n = window_index(now, w, win)
  if win ~= n then count = 0 end
  local until_end = max(0, (n + 1) * w - now)
  if count + cost <= limit then
    return true, limit - count - cost, until_end, 0, {n, count + cost}, until_end
  end
  return false, 0, until_end, 0
end

-- State {window index, previous window's count, current window's count}.
local function sliding_window(s, limit, w, now, cost)
  local win, sprev, scur = nil, 0, 0
  if s then win, sprev, scur = s[1], s[2], s[3] end
  local n = window_index(now, w, win)
  local prev, cur = 0, 0
  if win == n then prev, cur = sprev, scur
  elseif win == n - 1 then prev, cur = scur, 0 end
  local ws = n * w
  local allow_at
  local need = limit - cost - cur
  if need >= 0 then
    if prev <= need then allow_at = ws else allow_at = ws + w * (prev - need) / prev end
  else
    local ws2, need2, prev2 = ws + w, limit - cost, cur
    if prev2 <= need2 then allow_at = ws2 else allow_at = ws2 + w * (prev2 - need2) / prev2 end
  end
  if now >= allow_at then
    local cur1 = cur + cost
    local remaining = floor(limit - cur1 - prev * (ws + w - now) / w)
    if remaining < 0 then remaining = 0 end
    local until_end = ceil_us(ws + w - now)
    local ttl = ceil_us(ws + 2 * w - now)
    return true, remaining, until_end, 0, {n, prev, cur1}, ttl
  end
  local retry = ceil_us(ceil(allow_at) - now)
  return false, 0, retry, 0
end

-- A quota's period: state {its end, count}; kept QUOTA_KEEP_US past its end.
local function quota(s, limit, stop, now, cost)
  local count = 0
  if s and s[1] == stop then count = s[2] end
  local left = max(0, stop - now)
  if count + cost <= limit then
    return true, limit - count - cost, left, 0, {stop, count + cost}, left + QUOTA_KEEP_US
  end
  return false, 0, left, 0
end

-- The log is a sorted set read in place; its "state" is the count of live
-- entries, which the commit needs to name the new members (one per token).
local function sliding_log(key, limit, w, now, cost)
  local live = '(' .. format('%d', now - w)
  local count = call('ZCOUNT', key, live, '+inf')
  if count + cost <= limit then
    local oldest = now
    local first = call('ZRANGEBYSCORE', key, live, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if first[2] then oldest = tonum(first[2]) end
    return true, limit - count - cost, max(0, oldest + w - now), 0, count, w
  end
  -- Enough entries must expire to leave limit - cost: the (count + cost - limit)th.
  local entry = call('ZRANGEBYSCORE', key, live, '+inf', 'WITHSCORES', 'LIMIT', count + cost - limit - 1, 1)
  local retry = max(1, tonum(entry[2]) + w - now)
  return false, 0, retry, 0
end

-- Stored text <-> state, per kind (a sliding log's key is a zset: MGET reads nil).
local function decode(kind, raw)
  if not raw then return nil end
  if kind <= 2 then return tonum(raw) end
  if kind == 3 or kind == 6 then
    local a, b = match(raw, '^(%-?%d+) (%d+)$')
    if a then return {tonum(a), tonum(b)} end
  elseif kind == 4 then
    local a, b, c = match(raw, '^(%-?%d+) (%d+) (%d+)$')
    if a then return {tonum(a), tonum(b), tonum(c)} end
  end
  return nil
end

local function encode(kind, s)
  -- A whole TAT (any rate dividing a second evenly) as an integer: cheaper
  -- to print than 17 significant digits, and it reads back the same.
  if kind <= 2 then
    if s == floor(s) then return format('%d', s) end
    return s
  end
  if kind == 3 or kind == 6 then return format('%d %d', s[1], s[2]) end
  return format('%d %d %d', s[1], s[2], s[3])
end

local now
-- A key's time to live runs on Redis's clock. A caller that names `now` (the
-- tests, moving a clock by hand) does not share it: such keys are kept at
-- least a minute, so real time never expires a state the caller's time still
-- needs. (A state kept past its time reads as an empty bucket: no decision
-- changes.)
local min_px = 1
local when, marker = ARGV[1], nil
if string.find(when, '|', 1, true) then
  when, marker = match(when, '^([^|]*)|(.+)$')
end
if when ~= '' and string.sub(when, 1, 1) ~= 'd' then
  now = tonum(when)
  min_px = 60000
else
  local t = call('TIME')
  now = tonum(t[1]) * 1000000 + tonum(t[2])
  local deadline = tonum(string.sub(when, 2))
  if deadline and now > deadline then
    return redis.error_reply(format('limiter.lua: late by %d us: nothing written', now - deadline))
  end
end
if marker and call('EXISTS', marker) == 1 then
  return redis.error_reply('limiter.lua: late by 0 us: its caller gave it up (' .. marker .. '): nothing written')
end

local function bad(why)
  return redis.error_reply('limiter.lua: ' .. why .. ' (' .. #KEYS .. ' keys, ' .. #ARGV .. ' arguments)')
end

-- The arguments are checked whole before anything is read or written, so a
-- malformed call changes nothing.
-- A count or an index: a whole number in range (tonumber also reads "nan",
-- "inf" and hex; none of those is one).
local function whole(x, lo, hi)
  return x ~= nil and x == x and x % 1 == 0 and x >= lo and x <= hi
end
local na = #ARGV
local nx = tonum(ARGV[4])
if not whole(nx, 0, na - 4) then
  return bad('expected the number of buckets named in ARGV')
end
local names = KEYS
if nx > 0 then
  names = {unpack(KEYS)}
  for i = 1, nx do names[#KEYS + i] = ARGV[4 + i] end
end
local nk = #names
local m, ns = tonum(ARGV[2]), tonum(ARGV[3])
if not whole(m, 0, na) or not whole(ns, 0, na) then
  return bad('expected the numbers of requests and shapes')
end
-- Per bucket, what its algorithm needs, worked out once per batch rather
-- than once per request (the same expressions as algorithms/*.rs):
-- GCRA: emission interval, tolerance and size; windows: length in us.
local kinds, p1s, ts, taus, lims, ws = {}, {}, {}, {}, {}, {}
for k = 1, nk do
  local b = 3 * k + 2 + nx
  local kind, p1, p2 = tonum(ARGV[b]), tonum(ARGV[b + 1]), tonum(ARGV[b + 2])
  if not whole(kind, 1, 6) or p1 == nil or p2 == nil or not (p1 > 0 and p1 < huge)
      or not (p2 >= 0 and p2 < huge) then
    return bad('bucket ' .. k .. ' has no valid kind, p1, p2')
  end
  kinds[k], p1s[k] = kind, p1
  if kind == 1 then
    local t = 1e6 / p2
    ts[k], taus[k], lims[k] = t, t * (p1 - 1), p1
  elseif kind == 2 then
    local t, tau = 1e6 / p1, p2 * 1000.0
    ts[k], taus[k], lims[k] = t, tau, floor(tau / t) + 1
  elseif kind == 6 then
    ws[k] = p2
  else
    ws[k] = p2 * 1000000
  end
end
-- Shapes, parsed once: shape q's tiers are refs[start[q] + 1 .. start[q] + len[q]],
-- each a bucket index, negative for a shadow tier, with its cost in costs[].
local refs, costs, start, len, shape = {}, {}, {}, {}, {}
local lease_at
do
  local a, nrefs = 3 * nk + 5 + nx, 0
  for q = 1, ns do
    local n = tonum(ARGV[a])
    if not whole(n, 0, (na - a) / 2) then return bad('arguments end inside shape ' .. q) end
    start[q], len[q] = nrefs, n
    for i = a + 1, a + 2 * n, 2 do
      local k, c = tonum(ARGV[i]), tonum(ARGV[i + 1])
      if not whole(k, -nk, nk) or k == 0 then
        return bad('shape ' .. q .. ' names no bucket')
      end
      if not whole(c, 1, 2 ^ 40) then return bad('shape ' .. q .. ' has no valid cost') end
      nrefs = nrefs + 1
      refs[nrefs], costs[nrefs] = k, c
    end
    a = a + 1 + 2 * n
  end
  if a + m > na + 1 then return bad('expected one shape per request') end
  for r = 1, m do
    local q = tonum(ARGV[a + r - 1])
    if not whole(q, 1, ns) then return bad('request ' .. r .. ' names no shape') end
    shape[r] = q
  end
  lease_at = a + m
end
local nl, reps, g0, holder, hold = 0, 1, 1, nil, 0
local lk, lwant, lret, luntil, lspent, lreport = {}, {}, {}, {}, {}, {}
local leased = {}
if lease_at <= na then
  nl, reps, g0 = tonum(ARGV[lease_at]), tonum(ARGV[lease_at + 1]), tonum(ARGV[lease_at + 2])
  holder, hold = ARGV[lease_at + 3], tonum(ARGV[lease_at + 4])
  if not whole(nl, 0, na) or not whole(reps, 1, 2 ^ 31) or not whole(g0, 1, 2 ^ 40)
      or not (holder and match(holder, '^[0-9a-z]+$')) or not whole(hold, 0, 2 ^ 40)
      or lease_at + 4 + 6 * nl ~= na then
    return bad('expected leases after the requests')
  end
  for i = 1, nl do
    local b = lease_at + 6 * i - 1
    local k, want, ret, til = tonum(ARGV[b]), tonum(ARGV[b + 1]), tonum(ARGV[b + 2]), tonum(ARGV[b + 3])
    local spent, report = tonum(ARGV[b + 4]), tonum(ARGV[b + 5])
    if not whole(k, 1, nk) or kinds[k] == 2 or kinds[k] == 5 or not whole(want, -2 ^ 40, 2 ^ 40)
        or not whole(ret, 0, 2 ^ 40) or not whole(til, -2 ^ 53, 2 ^ 53)
        or not whole(spent, 0, 2 ^ 40) or not whole(report, 0, 2 ^ 53) then
      return bad('lease ' .. i .. ' is not a token bucket, window or quota with want, ret, until, spent, report')
    end
    lk[i], lwant[i], lret[i], luntil[i], lspent[i], lreport[i] = k, want, ret, til, spent, report
    leased[k] = true
  end
end

-- One read for every bucket of the batch; after that the batch works on
-- `state` and writes each changed bucket once at the end.
local state = {}
if nx > 0 then
  -- Several slots: one read per bucket (MGET cannot span slots); a log is
  -- only checked to be here (its entries are read when it is decided).
  for k = 1, nk do
    if kinds[k] == 5 then call('EXISTS', names[k])
    else state[k] = decode(kinds[k], call('GET', names[k])) end
  end
elseif nk > 0 then
  local raw = call('MGET', unpack(KEYS))
  for k = 1, nk do state[k] = decode(kinds[k], raw[k]) end
end
local dirty, ttl_of, ndirty = {}, {}, 0
local function touch(k, ttl)
  if not ttl_of[k] then
    ndirty = ndirty + 1
    dirty[ndirty] = k
  end
  ttl_of[k] = ttl
end

-- Quota ledgers (see the top): read for a bucket this call leases, or one
-- its requests might find short; expired holdings are given back first.
local ledgers, lchanged = {}, {}
do
  local cost = {}
  for r = 1, m do
    local q = shape[r]
    for j = start[q] + 1, start[q] + len[q] do
      local k = refs[j]
      if k < 0 then k = -k end
      if kinds[k] == 6 then cost[k] = (cost[k] or 0) + costs[j] end
    end
  end
  for k = 1, nk do
    local s = state[k]
    if kinds[k] == 6 and (leased[k]
        or (cost[k] and s and s[1] == ws[k] and s[2] + cost[k] > p1s[k])) then
      -- Per holder {out, reclaim_at, told, forget_at}.
      local l = {}
      local raw = call('HGETALL', '{' .. names[k] .. '}:leases')
      for j = 1, #raw, 2 do
        local f, v = raw[j], raw[j + 1]
        local h = match(f, '^([0-9a-z]+)%.t$')
        if h then
          local t, fa = match(v, '^(%d+):(%-?%d+)$')
          if t then
            local e = holding(l, h)
            e[3], e[4] = tonum(t), tonum(fa)
          end
        else
          local o, at = match(v, '^(%d+) (%-?%d+)$')
          if o then
            local e = holding(l, f)
            e[1], e[2] = tonum(o), tonum(at)
          end
        end
      end
      for h, e in pairs(l) do
        -- Never the caller's own: alive, it reports what it spent.
        if e[1] > 0 and e[2] <= now and h ~= holder then
          if s and s[1] == ws[k] then
            local back = e[1]
            if back > s[2] then back = s[2] end
            s = {s[1], s[2] - back}
            state[k] = s
            touch(k, max(0, s[1] - now) + QUOTA_KEEP_US)
          end
          e[1] = 0
          lchanged[k] = true
        end
        if e[3] > 0 and e[4] <= now then
          e[3] = 0
          lchanged[k] = true
        end
        if e[1] == 0 and e[3] == 0 then l[h] = nil end
      end
      ledgers[k] = l
    end
  end
end

-- A quota's reports counted before are skipped (their call ran and its
-- answer was lost); the others are booked as counted.
local lskip = {}
for i = 1, nl do
  local k, report = lk[i], lreport[i]
  if kinds[k] == 6 and report > 0 then
    local e = ledgers[k][holder]
    if e and e[3] >= report then
      lskip[i] = true
    else
      e = holding(ledgers[k], holder)
      e[3], e[4] = report, now + hold + TOLD_KEEP_US
      lchanged[k] = true
    end
  end
end

-- A quota's leased tokens its holder spent: no longer Redis's to take back.
-- Spending beyond what it holds is a late report (Redis took those tokens
-- back while the holder was cut off): charged to the count again, as the
-- fallback's debts are.
for i = 1, nl do
  local k, sp = lk[i], lspent[i]
  if kinds[k] == 6 and sp > 0 and not lskip[i] then
    local e = ledgers[k][holder]
    if e then
      local own = sp
      if own > e[1] then own = e[1] end
      e[1], sp = e[1] - own, sp - own
      lchanged[k] = true
    end
    local s = state[k]
    if sp > 0 and s and s[1] == ws[k] then
      state[k] = {s[1], s[2] + sp}
      touch(k, max(0, s[1] - now) + QUOTA_KEEP_US)
    end
  end
end

-- Unspent tokens of expired leases, taken back where that is exact
-- (algorithms/lease.rs): a quota's only up to what its ledger holds.
local lback = {}
for i = 1, nl do
  local k, ret, til, s = lk[i], lret[i], luntil[i], state[lk[i]]
  lback[i] = 0
  if lskip[i] then
    lback[i], ret = -1, 0
  elseif kinds[k] == 6 then
    local e = ledgers[k][holder]
    if not e then ret = 0
    elseif ret > e[1] then ret = e[1] end
  end
  if ret > 0 and s then
    local kind = kinds[k]
    if kind == 1 then
      -- As many as lie above the floor.
      local b = floor((s - til) / ts[k])
      if b > ret then b = ret end
      if now <= til and b >= 1 then
        local tat = s - b * ts[k]
        state[k] = tat
        touch(k, ceil_us(tat - now))
        lback[i] = b
      end
    elseif s[1] == til then
      local w = ws[k]
      if kind == 3 and s[2] >= ret then
        state[k] = {s[1], s[2] - ret}
        touch(k, max(0, (s[1] + 1) * w - now))
        lback[i] = ret
      elseif kind == 4 and s[3] >= ret then
        state[k] = {s[1], s[2], s[3] - ret}
        touch(k, ceil_us(s[1] * w + 2 * w - now))
        lback[i] = ret
      elseif kind == 6 and s[2] >= ret then
        state[k] = {s[1], s[2] - ret}
        touch(k, max(0, s[1] - now) + QUOTA_KEEP_US)
        lback[i] = ret
        local e = ledgers[k][holder]
        e[1] = e[1] - ret
        lchanged[k] = true
      end
    end
  end
end

-- Per tier of the request being decided (reused across requests).
local t_key, t_ok, t_new, t_ttl, t_cost = {}, {}, {}, {}, {}

local out, no = {}, 0
-- Per request, what the marker says of it.
local ran = {}
for r = 1, m do
  local q = shape[r]
  local n, j = len[q], start[q]
  local admit = true
  local full = true
  for i = 1, n do
    local k, c = refs[j + i], costs[j + i]
    local shadow = k < 0
    if shadow then k = -k end
    local kind, s = kinds[k], state[k]
    local ok, remaining, reset, delay, new, ttl
    if kind <= 2 then
      ok, remaining, reset, delay, new, ttl = gcra(s, ts[k], taus[k], lims[k], kind == 2, now, c)
    elseif kind == 3 then
      ok, remaining, reset, delay, new, ttl = fixed_window(s, p1s[k], ws[k], now, c)
    elseif kind == 4 then
      ok, remaining, reset, delay, new, ttl = sliding_window(s, p1s[k], ws[k], now, c)
    elseif kind == 6 then
      ok, remaining, reset, delay, new, ttl = quota(s, p1s[k], ws[k], now, c)
    else
      ok, remaining, reset, delay, new, ttl = sliding_log(names[k], p1s[k], ws[k], now, c)
    end
    if not ok then
      if shadow then full = false else admit = false end
    end
    t_key[i], t_ok[i], t_new[i], t_ttl[i], t_cost[i] = k, ok, new, ttl, c
    if not ok then
      -- What the bucket holds: what a request of cost 1 would be told, plus it.
      local held = 0
      if c > 1 then
        local ok1, rem1
        if kind <= 2 then
          ok1, rem1 = gcra(s, ts[k], taus[k], lims[k], kind == 2, now, 1)
        elseif kind == 3 then
          ok1, rem1 = fixed_window(s, p1s[k], ws[k], now, 1)
        elseif kind == 4 then
          ok1, rem1 = sliding_window(s, p1s[k], ws[k], now, 1)
        elseif kind == 6 then
          ok1, rem1 = quota(s, p1s[k], ws[k], now, 1)
        else
          ok1, rem1 = sliding_log(names[k], p1s[k], ws[k], now, 1)
        end
        if ok1 then held = rem1 + 1 end
      end
      remaining = -1 - held
    end
    out[no + 1], out[no + 2] = remaining, reset
    no = no + 2
    if kind == 2 then
      no = no + 1
      out[no] = delay
    end
  end
  ran[r] = admit and (full and '1' or '2') or '0'
  if admit then
    for i = 1, n do
      if t_ok[i] then
        local k = t_key[i]
        if kinds[k] == 5 then
          -- A log is written at once: the next request of the batch counts it.
          local key, w, count = names[k], t_ttl[i], t_new[i]
          call('ZREMRANGEBYSCORE', key, '-inf', format('%d', now - w))
          local at = format('%d', now)
          for e = 0, t_cost[i] - 1 do
            call('ZADD', key, at, format('%d:%d', now, count + e))
          end
          call('PEXPIRE', key, max(min_px, ceil(w / 1000)))
        else
          state[k] = t_new[i]
          touch(k, t_ttl[i])
        end
      end
    end
  end
end

-- Grants: the smaller of what was asked and a fair share of what is left,
-- taken as a request of that cost.
for i = 1, nl do
  local k, want, s = lk[i], lwant[i], state[lk[i]]
  local kind, avail = kinds[k], 0
  if kind == 1 then
    local tat = now
    if s and s > now then tat = s end
    avail = floor((now + taus[k] - tat) / ts[k]) + 1
    if avail > lims[k] then avail = lims[k] end
  elseif kind == 6 then
    avail = p1s[k]
    if s and s[1] == ws[k] then avail = p1s[k] - s[2] end
  else
    local w = ws[k]
    local n = window_index(now, w, s and s[1])
    if kind == 3 then
      avail = p1s[k]
      if s and s[1] == n then avail = p1s[k] - s[2] end
    else
      local prev, cur = 0, 0
      if s and s[1] == n then prev, cur = s[2], s[3]
      elseif s and s[1] == n - 1 then prev = s[3] end
      avail = floor(p1s[k] - cur - prev * (n * w + w - now) / w)
    end
  end
  local g, least = floor(avail / reps), g0
  if want < 0 then g, want, least = avail, -want, 1 end
  if g > want then g = want end
  local granted, til = 0, 0
  if g >= least then
    local ok, new, ttl, _
    if kind == 1 then
      ok, _, _, _, new, ttl = gcra(s, ts[k], taus[k], lims[k], false, now, g)
    elseif kind == 3 then
      ok, _, _, _, new, ttl = fixed_window(s, p1s[k], ws[k], now, g)
    elseif kind == 6 then
      ok, _, _, _, new, ttl = quota(s, p1s[k], ws[k], now, g)
    else
      ok, _, _, _, new, ttl = sliding_window(s, p1s[k], ws[k], now, g)
    end
    if ok then
      if kind == 1 then
        til = now
        if s and s > now then til = floor(s) end
      else
        til = new[1]
      end
      state[k] = new
      touch(k, ttl)
      granted = g
      if kind == 6 then
        local e = holding(ledgers[k], holder)
        e[1], e[2] = e[1] + g, now + hold
        if e[3] > 0 then e[4] = now + hold + TOLD_KEEP_US end
        lchanged[k] = true
      end
    end
  end
  out[no + 1], out[no + 2], out[no + 3] = granted, til, lback[i]
  no = no + 3
end

for j = 1, ndirty do
  local ki = dirty[j]
  call('SET', names[ki], encode(kinds[ki], state[ki]), 'PX', max(min_px, ceil(ttl_of[ki] / 1000)))
end
-- A ledger is rewritten whole (a field per holder: a few) and kept as long
-- as its count; holdings settled to 0 leave it.
for k, _ in pairs(lchanged) do
  local key = '{' .. names[k] .. '}:leases'
  call('DEL', key)
  local args, n = {}, 0
  for h, e in pairs(ledgers[k]) do
    if e[1] > 0 then
      args[n + 1], args[n + 2] = h, format('%d %d', e[1], e[2])
      n = n + 2
    end
    if e[3] > 0 then
      args[n + 1], args[n + 2] = h .. '.t', format('%d:%d', e[3], e[4])
      n = n + 2
    end
  end
  if n > 0 then
    call('HSET', key, unpack(args))
    call('PEXPIRE', key, max(min_px, ceil((max(0, ws[k] - now) + QUOTA_KEEP_US) / 1000)))
  end
end
if marker and m > 0 then
  call('SET', marker, table.concat(ran), 'PX', MARK_LIFE_MS)
end
out[no + 1] = now
return out
