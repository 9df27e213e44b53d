--[[ charge.lua: on failback, add what one replica admitted on its local
fallback during a Redis outage to the shared buckets, so a client does not
get its local shares and then a full shared bucket on top.

KEYS     the buckets to charge (built by keys.rs; never a secret)
ARGV[1]  now in microseconds since the epoch, or "" to use Redis's own TIME,
         or "d<deadline>": Redis's TIME, and past that deadline the call
         writes nothing and fails with "late" (a charge the gateway gave up
         on is charged again: run late as well, it would charge twice)
ARGV[2]  this replica's id: a log entry is named by its time, this id and
         its rank among entries of the same time, so two replicas' entries
         stay apart and charging the same debt twice adds nothing
ARGV[3]  a marker, or "": a call with a marker writes it (for ten minutes)
         with what it writes, and a call whose marker is already there
         writes nothing and returns 0: it ran before, and its answer was
         lost (a settlement sent again under the same marker)
then per bucket (KEYS[k], in order): kind, p1, p2 (as in limiter.lua), then
n, the number of debt values, then the values:
         kind 1, 2 (GCRA)     count, tat   tat: the arrival time of these
                                           admissions alone
         kind 3 (fixed)       window, count
         kind 4 (sliding)     window, prev, cur
         kind 5 (log)         the admission times
         kind 6 (quota)       end, count   end: the period's (p2)

A settlement (a charged answer's cost against its estimate: settle in
src/limiter/redis/mod.rs) uses the same values with a signed count: positive
is owed at now (kind 1, 2: tat = now + count * T), negative given back (kind
1, 2: tat = now; a window's and a quota's in the window it was taken in). A
refund never takes a bucket past full (a TAT back to now deletes the key) nor
a count below zero.

Returns the number of buckets written.

Worked example: 4 requests admitted locally from a token bucket of 20 at 10/s
between 1700000000000000 and 1700000000000300 (tat 1700000000400000), the
shared bucket holding tat 1700000000900000, charged at 1700000000000400:
  EVALSHA <sha> 1 rl:key:free:tb-20-10:k:demo 1700000000000400 t1 ""
          1 20 10  2 4 1700000000400000
  -> the bucket holds max(1700000000900000 + 4 * 100000, 1700000000400000)
     = 1700000001300000, and 1 is returned.

GCRA: replaying admissions at t1..tn one by one onto a TAT t0 gives exactly
max(t0 + n * T, tat), so a debt is two numbers however long the outage was.
A t0 that has passed counts as a full bucket (the key would have expired).
The arithmetic mirrors `outage::charge` in src/limiter/algorithms/outage.rs.
]]

local floor, max, format = math.floor, math.max, string.format
local call, tonum = redis.call, tonumber

local now
-- As in limiter.lua: keys of a caller naming `now` live at least a minute.
local min_px = 1
if ARGV[1] ~= '' and string.sub(ARGV[1], 1, 1) ~= 'd' then
  now = tonum(ARGV[1])
  min_px = 60000
else
  local t = call('TIME')
  now = tonum(t[1]) * 1000000 + tonum(t[2])
  local deadline = tonum(string.sub(ARGV[1], 2))
  if deadline and now > deadline then
    return redis.error_reply(format('charge.lua: late by %d us: nothing written', now - deadline))
  end
end
-- As in limiter.lua: a quota period's count is kept this long past its end
-- (the gateway builds the script with limiter.quota_retention_days).
local QUOTA_KEEP_US = 60000000
local tag = ARGV[2]
local marker = ARGV[3]
local MARK_PX = 600000

local function bad(why)
  return redis.error_reply('charge.lua: ' .. why)
end

local function ceil_us(x)
  if x <= 0 then return 0 end
  return math.ceil(x)
end

local function roll(win, prev, cur, n)
  if win == n then return prev, cur end
  if win == n - 1 then return cur, 0 end
  return 0, 0
end

-- Checked whole first: a malformed call writes nothing.
local a, plan = 4, {}
for k = 1, #KEYS do
  local kind, p1, p2, n = tonum(ARGV[a]), tonum(ARGV[a + 1]), tonum(ARGV[a + 2]), tonum(ARGV[a + 3])
  if kind == nil or kind < 1 or kind > 6 or kind % 1 ~= 0 or p1 == nil or p2 == nil
      or n == nil or n < 0 or n % 1 ~= 0 or a + 3 + n > #ARGV then
    return bad('bucket ' .. k .. ' has no valid kind, p1, p2, n')
  end
  local v = {}
  for i = 1, n do
    v[i] = tonum(ARGV[a + 3 + i])
    if v[i] == nil then return bad('bucket ' .. k .. ' has a value that is no number') end
  end
  if (kind <= 2 and n ~= 2) or (kind == 3 and n ~= 2) or (kind == 4 and n ~= 3) or (kind == 6 and n ~= 2) then
    return bad('bucket ' .. k .. ' has ' .. n .. ' values for kind ' .. kind)
  end
  plan[k] = {kind, p1, p2, v}
  a = a + 4 + n
end
if a ~= #ARGV + 1 then return bad('arguments left over') end
if marker ~= '' and not call('SET', marker, '1', 'NX', 'PX', MARK_PX) then
  return 0
end

local written = 0
for k = 1, #KEYS do
  local key, kind, p1, p2, v = KEYS[k], plan[k][1], plan[k][2], plan[k][3], plan[k][4]
  if kind <= 2 then
    local t
    if kind == 1 then t = 1e6 / p2 else t = 1e6 / p1 end
    local count, tat = v[1], v[2]
    local stored = tonum(call('GET', key))
    -- A TAT that has passed is a full bucket: the debt alone counts.
    local replayed = tat
    if stored and stored > now then replayed = max(stored + count * t, tat) end
    if replayed > now then
      local out = replayed
      if replayed == floor(replayed) then out = format('%d', replayed) end
      call('SET', key, out, 'PX', max(min_px, math.ceil(ceil_us(replayed - now) / 1000)))
      written = written + 1
    elseif count < 0 and stored and stored > now then
      -- A refund that makes the bucket full: an absent key is a full bucket.
      call('DEL', key)
      written = written + 1
    end
  elseif kind == 3 then
    local w = p2 * 1000000
    local n = (now - math.fmod(now, w)) / w
    local raw = call('GET', key)
    local sw, sc
    if raw then
      local x, y = string.match(raw, '^(%-?%d+) (%d+)$')
      if x then sw, sc = tonum(x), tonum(y) end
    end
    if sw and sw > n then n = sw end
    if v[1] == n then
      local base = 0
      if sw == n then base = sc end
      local ttl = max(0, (n + 1) * w - now)
      call('SET', key, format('%d %d', n, max(0, base + v[2])), 'PX', max(min_px, math.ceil(ttl / 1000)))
      written = written + 1
    end
  elseif kind == 6 then
    -- The period's own key: the debt adds to its count, while it is kept.
    local stop = p2
    if v[1] == stop and now < stop + 60000000 then
      local raw = call('GET', key)
      local base = 0
      if raw then
        local x, y = string.match(raw, '^(%-?%d+) (%d+)$')
        if x and tonum(x) == stop then base = tonum(y) end
      end
      local ttl = max(0, stop - now) + QUOTA_KEEP_US
      call('SET', key, format('%d %d', stop, max(0, base + v[2])), 'PX', max(min_px, math.ceil(ttl / 1000)))
      written = written + 1
    end
  elseif kind == 4 then
    local w = p2 * 1000000
    local n = (now - math.fmod(now, w)) / w
    local raw = call('GET', key)
    local sw, sp, sc
    if raw then
      local x, y, z = string.match(raw, '^(%-?%d+) (%d+) (%d+)$')
      if x then sw, sp, sc = tonum(x), tonum(y), tonum(z) end
    end
    if sw and sw > n then n = sw end
    local p0, c0 = 0, 0
    if sw then p0, c0 = roll(sw, sp, sc, n) end
    local dp, dc = roll(v[1], v[2], v[3], n)
    if dp ~= 0 or dc ~= 0 then
      local ttl = max(0, (n + 2) * w - now)
      call('SET', key, format('%d %d %d', n, max(0, p0 + dp), max(0, c0 + dc)), 'PX', max(min_px, math.ceil(ttl / 1000)))
      written = written + 1
    end
  else
    local w = p2 * 1000000
    local any, rank = false, 0
    for i = 1, #v do
      if i > 1 and v[i] == v[i - 1] then rank = rank + 1 else rank = 0 end
      if v[i] > now - w then
        call('ZADD', key, format('%d', v[i]), format('%d:%s:%d', v[i], tag, rank))
        any = true
      end
    end
    if any then
      call('ZREMRANGEBYSCORE', key, '-inf', format('%d', now - w))
      call('PEXPIRE', key, max(min_px, math.ceil(w / 1000)))
      written = written + 1
    end
  end
end
return written
