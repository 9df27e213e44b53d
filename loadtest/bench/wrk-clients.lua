-- wrk script for loadtest/bench.sh --clients N: every request comes from one
-- of N distinct clients, named in X-Forwarded-For (the gateway trusts
-- 127.0.0.1 as a proxy), drawn from a Zipf distribution: the client of rank r
-- sends in proportion to 1 / r^S. A client is "over" its limit when
-- (r * 503) % 10000 < PCT * 100 (PCT % of the ranks, spread over hot and cold
-- alike; 503 is prime to 10000, so every block of 10000 ranks holds exactly
-- that share); the over clients ask for $CLIENTS_OVER_PATH, whose route lets
-- each client through once, so after its first request every one is a 429.
-- The other headers (-H) are kept. At the end, the JSON summary of
-- wrk-summary.lua ($WRK_JSON), loaded from $WRK_SUMMARY_LUA.
--
--   CLIENTS_N        distinct clients (at most 4,194,304: 100.64.0.0/10)
--   CLIENTS_ZIPF     the exponent S (1.0; 0 = every client alike)
--   CLIENTS_OVER_PCT the percentage of clients over their limit (3)
--   CLIENTS_PATH, CLIENTS_OVER_PATH  the two paths
--
-- Addresses are header text only: no packet is ever sent to them. Each thread
-- draws from its own generator, seeded by its number, so runs repeat.

dofile(os.getenv("WRK_SUMMARY_LUA"))

local n = tonumber(os.getenv("CLIENTS_N") or "100000")
local s = tonumber(os.getenv("CLIENTS_ZIPF") or "1.0")
local over_pct = tonumber(os.getenv("CLIENTS_OVER_PCT") or "3")
local path = os.getenv("CLIENTS_PATH") or "/"
local over_path = os.getenv("CLIENTS_OVER_PATH") or "/over"
local counter = 0

function setup(thread)
  thread:set("id", counter)
  counter = counter + 1
end

-- The cumulative distribution over ranks 1..n, built once per thread
-- (n doubles); a request is one uniform draw and a binary search.
local cdf
local headers

function init(args)
  math.randomseed(1000 + id)
  cdf = {}
  local total = 0
  for r = 1, n do
    total = total + 1 / r ^ s
    cdf[r] = total
  end
  for r = 1, n do
    cdf[r] = cdf[r] / total
  end
  headers = {}
  for k, v in pairs(wrk.headers) do
    headers[k] = v
  end
end

local function rank()
  local u = math.random()
  local lo, hi = 1, n
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if cdf[mid] < u then lo = mid + 1 else hi = mid end
  end
  return lo
end

function request()
  local r = rank()
  local c = r - 1
  headers["X-Forwarded-For"] = string.format("100.%d.%d.%d", 64 + math.floor(c / 65536), math.floor(c / 256) % 256,
    c % 256)
  local p = ((r * 503) % 10000 < over_pct * 100) and over_path or path
  return wrk.format("GET", p, headers)
end
