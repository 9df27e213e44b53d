--[[ heartbeat.lua: a replica says it is alive and learns how many are.

KEYS[1]  the replica set, a sorted set: member = a replica's random id,
         score = when its announcement expires (Redis's clock, in ms)
ARGV[1]  this replica's id (random, never a secret)
ARGV[2]  how long the announcement lasts, in ms

Returns the number of replicas whose announcement has not expired, this one
included. Redis's own clock decides expiry, so replicas with skewed clocks
still agree.

Worked example, at Redis time 1700000000000 ms with one other live replica:
  EVALSHA <sha> 1 rl:replicas 4f1c9a2e 3000  -> 2
]]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
if ttl == nil or ttl < 1 then return redis.error_reply('heartbeat.lua: ARGV[2] must be a TTL in ms') end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ttl)
return redis.call('ZCARD', KEYS[1])
