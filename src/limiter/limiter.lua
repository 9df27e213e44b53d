--[[ limiter.lua: decide every tier of one request, all or nothing, in one call.

KEYS[i]  the bucket of tier i (built by keys.rs; never holds a secret)
ARGV[1]  now in microseconds since the epoch, or "" to use Redis's own TIME
ARGV[2]  n, the number of tiers (must equal #KEYS)
ARGV[3 + 4(i-1) ..] per tier, four values:
         kind    1 token_bucket   p1 = capacity  p2 = refill per second
                 2 leaky_bucket   p1 = rate/s    p2 = max delay in ms
                 3 fixed_window   p1 = limit     p2 = window seconds
                 4 sliding_window p1 = limit     p2 = window seconds
                 5 sliding_log    p1 = limit     p2 = window seconds
         p1, p2  as above (rates may be fractional)
         shadow  "1": decide and report, never block the others

Returns 5n + 1 integers: for each tier
  allowed (1/0), remaining, retry_after_us, reset_after_us, delay_us
then the `now` that was used.

Every tier is checked first; only if every non-shadow tier admits are the
admitting tiers written. A rejected request charges no tier.

Worked example: a token bucket of 20 at 10/s for one key, a fixed window of
10/min for the route, at now = 1700000000000000:
  EVALSHA <sha> 2 rl:key:free:tb-20-10:k:demo rl:route:zone-stats:fw-10-60:global
          1700000000000000 2  1 20 10 0  3 10 60 0
  -> 1 19 0 100000 0   1 9 0 40000000 0   1700000000000000
(the bucket is full after 100 ms; the window ends 40 s later).

The arithmetic mirrors src/limiter/algorithms/*.rs operation for operation, in
the same order, so Lua's doubles and Rust's f64 agree to the bit.
]]

-- Locals: a global lookup per math call adds up at tens of thousands of calls a second.
local floor, ceil, max, fmod, format = math.floor, math.ceil, math.max, math.fmod, string.format
local call, tonum, unpack = redis.call, tonumber, unpack

local function ceil_us(x)
  if x <= 0 then return 0 end
  return ceil(x)
end

-- Writes are collected as (key, value, ttl in ms) and applied only if every
-- enforcing tier admits; a sliding log's write is marked with value false.
local wkey, wval, wttl, nw = {}, {}, {}, 0
local function write(key, value, ttl_us)
  nw = nw + 1
  wkey[nw], wval[nw], wttl[nw] = key, value, max(1, ceil(ttl_us / 1000))
end

-- GCRA: token bucket (tau = (capacity-1)*T) and leaky bucket (tau = max delay).
-- `v` is the bucket's stored value, read for every tier with one MGET.
local function gcra(key, v, t, tau, shaping, now)
  local tat = now
  if v then tat = tonum(v) end
  local allow_at = tat - tau
  if now >= allow_at then
    local slot = max(tat, now)
    local new_tat = slot + t
    local remaining = floor((now + tau - new_tat) / t) + 1
    if remaining < 0 then remaining = 0 end
    local reset = ceil_us(new_tat - now)
    local delay = 0
    if shaping then delay = ceil_us(slot - now) end
    return 1, remaining, 0, reset, delay, format('%.17g', new_tat), reset
  end
  local retry = ceil_us(ceil(allow_at) - now)
  return 0, 0, retry, retry, 0
end

local function window_index(now, w, stored)
  local n = (now - fmod(now, w)) / w
  if stored and stored > n then n = stored end
  return n
end

local function fixed_window(v, limit, w, now)
  local win, count = nil, 0
  if v then
    local a, b = string.match(v, '^(%-?%d+) (%d+)$')
    win = tonum(a)
    count = tonum(b)
  end
  local n = window_index(now, w, win)
  if win ~= n then count = 0 end
  local until_end = max(0, (n + 1) * w - now)
  if count < limit then
    return 1, limit - count - 1, 0, until_end, 0, format('%d %d', n, count + 1), until_end
  end
  return 0, 0, until_end, until_end, 0
end

local function sliding_window(v, limit, w, now)
  local win, sprev, scur = nil, 0, 0
  if v then
    local a, b, c = string.match(v, '^(%-?%d+) (%d+) (%d+)$')
    win, sprev, scur = tonum(a), tonum(b), tonum(c)
  end
  local n = window_index(now, w, win)
  local prev, cur = 0, 0
  if win == n then prev, cur = sprev, scur
  elseif win == n - 1 then prev, cur = scur, 0 end
  local ws = n * w
  local allow_at
  local need = limit - 1 - cur
  if need >= 0 then
    if prev <= need then allow_at = ws else allow_at = ws + w * (prev - need) / prev end
  else
    local ws2, need2, prev2 = ws + w, limit - 1, cur
    if prev2 <= need2 then allow_at = ws2 else allow_at = ws2 + w * (prev2 - need2) / prev2 end
  end
  if now >= allow_at then
    local cur1 = cur + 1
    local remaining = floor(limit - cur1 - prev * (ws + w - now) / w)
    if remaining < 0 then remaining = 0 end
    local until_end = ceil_us(ws + w - now)
    local ttl = ceil_us(ws + 2 * w - now)
    return 1, remaining, 0, until_end, 0, format('%d %d %d', n, prev, cur1), ttl
  end
  local retry = ceil_us(ceil(allow_at) - now)
  return 0, 0, retry, retry, 0
end

local function sliding_log(key, limit, w, now)
  local lower = now - w
  local live = '(' .. format('%d', lower)
  local count = call('ZCOUNT', key, live, '+inf')
  if count < limit then
    local oldest = now
    local first = call('ZRANGEBYSCORE', key, live, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if first[2] then oldest = tonum(first[2]) end
    -- The log's write: value false marks it; the member is "<now>:<count>".
    return 1, limit - count - 1, 0, max(0, oldest + w - now), 0, false, w, count
  end
  local entry = call('ZRANGEBYSCORE', key, live, '+inf', 'WITHSCORES', 'LIMIT', count - limit, 1)
  local retry = max(1, tonum(entry[2]) + w - now)
  return 0, 0, retry, retry, 0
end

local now
if ARGV[1] ~= '' then
  now = tonum(ARGV[1])
else
  local t = call('TIME')
  now = tonum(t[1]) * 1000000 + tonum(t[2])
end
local n = tonum(ARGV[2])
if n == nil or #KEYS ~= n or #ARGV ~= 2 + 4 * n then
  return redis.error_reply('limiter.lua: expected n keys and 2 + 4n arguments, got ' .. #KEYS .. ' keys and ' .. #ARGV .. ' arguments')
end

-- One read for every string-valued bucket (a sliding log's zset reads as nil).
local values = call('MGET', unpack(KEYS))

local out, admit = {}, true
local logs = {}
for i = 1, n do
  local b = 2 + (i - 1) * 4
  local kind, p1, p2 = tonum(ARGV[b + 1]), tonum(ARGV[b + 2]), tonum(ARGV[b + 3])
  local shadow = ARGV[b + 4] == '1'
  local key, v = KEYS[i], values[i]
  local ok, remaining, retry, reset, delay, value, ttl, count
  if kind == 1 then
    local t = 1e6 / p2
    ok, remaining, retry, reset, delay, value, ttl = gcra(key, v, t, t * (p1 - 1), false, now)
  elseif kind == 2 then
    local t = 1e6 / p1
    ok, remaining, retry, reset, delay, value, ttl = gcra(key, v, t, p2 * 1000.0, true, now)
  elseif kind == 3 then
    ok, remaining, retry, reset, delay, value, ttl = fixed_window(v, p1, p2 * 1000000, now)
  elseif kind == 4 then
    ok, remaining, retry, reset, delay, value, ttl = sliding_window(v, p1, p2 * 1000000, now)
  elseif kind == 5 then
    ok, remaining, retry, reset, delay, value, ttl, count = sliding_log(key, p1, p2 * 1000000, now)
  else
    return redis.error_reply('limiter.lua: unknown algorithm kind ' .. tostring(ARGV[b + 1]))
  end
  if ok == 0 and not shadow then admit = false end
  if ok == 1 then
    if value then
      write(key, value, ttl)
    else
      logs[#logs + 1] = {key, ttl, count}
    end
  end
  out[#out + 1] = ok
  out[#out + 1] = remaining
  out[#out + 1] = retry
  out[#out + 1] = reset
  out[#out + 1] = delay
end
if admit then
  for i = 1, nw do
    call('SET', wkey[i], wval[i], 'PX', wttl[i])
  end
  for _, l in ipairs(logs) do
    local key, w, count = l[1], l[2], l[3]
    call('ZREMRANGEBYSCORE', key, '-inf', format('%d', now - w))
    call('ZADD', key, format('%d', now), format('%d:%d', now, count))
    call('PEXPIRE', key, max(1, ceil(w / 1000)))
  end
end
out[#out + 1] = now
return out
