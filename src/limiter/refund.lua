--[[ refund.lua: give back one admission that limiter.lua committed.

Used in Redis Cluster mode, where a request's tiers live in different slots
and are reserved one key at a time: if any enforcing tier then rejects, the
tiers that admitted are refunded so a rejected request charges no tier. And
for a request the rate tiers admitted that the in-flight caps then refused,
or whose client left while it was queued: it never reached the upstream.

KEYS[1]  the bucket
ARGV     kind p1 p2 (as for limiter.lua), now (the `now` the reservation
         returned), remaining (what the reservation returned for this tier),
         cost (the tokens the reservation took)

Returns 1 if something was given back, 0 if the bucket had already moved on
(expired, or a new window started: nothing left to refund).

Example: refund a token of a 20-per-10/s bucket reserved at 1700000000000000:
  EVALSHA <sha> 1 rl:key:free:tb-20-10:k:demo 1 20 10 1700000000000000 19 1  -> 1
]]

local key = KEYS[1]
local kind, p1, p2 = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now, remaining, cost = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
if kind == nil or now == nil or remaining == nil or cost == nil or cost < 1 then
  return redis.error_reply('refund.lua: expected kind p1 p2 now remaining cost')
end

if kind == 1 or kind == 2 then
  local t
  if kind == 1 then t = 1e6 / p2 else t = 1e6 / p1 end
  local v = redis.call('GET', key)
  if not v then return 0 end
  redis.call('SET', key, string.format('%.17g', tonumber(v) - cost * t), 'KEEPTTL')
  return 1
end

if kind == 3 or kind == 4 then
  local w = p2 * 1000000
  local n = (now - math.fmod(now, w)) / w
  local v = redis.call('GET', key)
  if not v then return 0 end
  if kind == 3 then
    local a, b = string.match(v, '^(%-?%d+) (%d+)$')
    if tonumber(a) ~= n or tonumber(b) < cost then return 0 end
    redis.call('SET', key, string.format('%d %d', n, tonumber(b) - cost), 'KEEPTTL')
  else
    local a, b, c = string.match(v, '^(%-?%d+) (%d+) (%d+)$')
    if tonumber(a) ~= n or tonumber(c) < cost then return 0 end
    redis.call('SET', key, string.format('%d %d %d', n, tonumber(b), tonumber(c) - cost), 'KEEPTTL')
  end
  return 1
end

if kind == 6 then
  -- A quota's period is its own key; p2 is its end.
  local v = redis.call('GET', key)
  if not v then return 0 end
  local a, b = string.match(v, '^(%-?%d+) (%d+)$')
  if tonumber(a) ~= p2 or tonumber(b) < cost then return 0 end
  redis.call('SET', key, string.format('%d %d', tonumber(a), tonumber(b) - cost), 'KEEPTTL')
  return 1
end

if kind == 5 then
  -- The members limiter.lua added: "<now>:<count before it + i>", i < cost.
  local count = p1 - cost - remaining
  local removed = 0
  for i = 0, cost - 1 do
    removed = removed + redis.call('ZREM', key, string.format('%d:%d', now, count + i))
  end
  return math.min(removed, 1)
end

return redis.error_reply('refund.lua: unknown algorithm kind ' .. tostring(ARGV[1]))
