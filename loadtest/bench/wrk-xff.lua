-- wrk script for the memory step of loadtest/bench.sh: every request names a
-- new client in X-Forwarded-For (the gateway trusts 127.0.0.1 as a proxy), so
-- the gateway's local backend creates one ip-tier bucket per request.
--
-- Addresses come from 100.64.0.0/10 (RFC 6598, 4,194,304 of them), as header
-- text only: no packet is ever sent to them. $XFF_CLIENTS (default 1200000)
-- distinct addresses are used in turn; past that they repeat. Each wrk thread
-- takes every Nth index ($XFF_THREADS: wrk's -t) so no two threads send the
-- same address.

local clients = tonumber(os.getenv("XFF_CLIENTS") or "1200000")
local path = os.getenv("XFF_PATH") or "/"
local nthreads = tonumber(os.getenv("XFF_THREADS") or "1")
local counter = 0

function setup(thread)
  thread:set("id", counter)
  counter = counter + 1
end

function init(args)
  i = id
end

function request()
  local n = i % clients
  i = i + nthreads
  local a = 64 + math.floor(n / 65536)
  local b = math.floor(n / 256) % 256
  local c = n % 256
  return wrk.format("GET", path, { ["X-Forwarded-For"] = string.format("100.%d.%d.%d", a, b, c) })
end
