-- wrk script for loadtest/bench.sh: the same request wrk sends anyway (no
-- request()/response() hooks, so wrk stays on its fast path), plus a JSON
-- summary written at the end to the file named by $WRK_JSON.
--   WRK_JSON=out.json wrk -s wrk-summary.lua -t2 -c32 -d10s http://127.0.0.1:PORT/path

done = function(summary, latency, requests)
  local path = os.getenv("WRK_JSON")
  local e = summary.errors
  local out = string.format(
    '{"requests":%d,"duration_us":%d,"bytes":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"latency_us":{"p50":%d,"p90":%d,"p99":%d,"max":%d,"mean":%.1f}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, latency.mean)
  if path and path ~= "" then
    local f = assert(io.open(path, "w"))
    f:write(out)
    f:close()
  else
    io.write(out)
  end
end
