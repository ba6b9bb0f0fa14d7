-- wrk script for the idemproxy benchmark. BENCH_MODE picks the request:
--   get     GET /            (nginx-proxy, passthrough)
--   keyed   POST /orders with a new Idempotency-Key on every request
--   replay  POST /orders with the one key in BENCH_KEY, completed beforehand
-- `done` prints one line starting with BENCH_JSON that bench/run reads.

local mode = os.getenv("BENCH_MODE") or "get"
-- The path keyed requests are sent to: /orders on idemproxy, /URL_ORDERS on the peer (bench/run --peer).
local path = os.getenv("BENCH_PATH") or "/orders"
local nonce = os.getenv("BENCH_NONCE") or tostring(os.time())
local order = '{"amount":1000,"currency":"EUR","customer":"c_123"}'
-- Keyed requests carry a credential, as real clients do: without one the proxy refuses them (400).
-- BENCH_CREDENTIAL replaces it (a bearer JWT, to measure a route with scope_jwt).
local credential = os.getenv("BENCH_CREDENTIAL") or "Bearer bench-client"

local threads = 0
function setup(thread)
   threads = threads + 1
   thread:set("thread_id", threads)
end

if mode == "keyed" then
   local counter = 0
   local headers = { ["Content-Type"] = "application/json", ["Authorization"] = credential }
   function request()
      counter = counter + 1
      headers["Idempotency-Key"] = nonce .. "-" .. thread_id .. "-" .. counter
      return wrk.format("POST", path, headers, order)
   end
elseif mode == "replay" then
   wrk.method = "POST"
   wrk.path = "/orders"
   wrk.body = order
   wrk.headers["Content-Type"] = "application/json"
   wrk.headers["Idempotency-Key"] = os.getenv("BENCH_KEY")
   wrk.headers["Authorization"] = credential
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'BENCH_JSON {"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,' ..
      '"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}\n',
      summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
      e.connect, e.read, e.write, e.status, e.timeout))
end
