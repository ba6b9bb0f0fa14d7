-- The claim, decided inside Redis in one script (atomic on the record's node): a new key is created; an
-- existing one is taken only when it is claimable (expired and not running under a live lease; or, for
-- the same fingerprint, released or past its lease). A takeover or retry keeps the expiry at least as
-- late as its lease. The record expires (Redis TTL) at its expiry or its lease end, whichever is later.
-- KEYS[1]: the record. ARGV: fingerprint, token, lease (ms), ttl (ms).
-- Returns {1, attempt, claim kind, expiry left (ms)} when this claim won (the expiry as it left it), else
-- {0, status, same fingerprint (0/1), token, lease left (ms), expiry left (ms), response status, headers,
-- body, body retained}.
local k = KEYS[1]
local fp, token = ARGV[1], ARGV[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lu = now + tonumber(ARGV[3])
local r = redis.call('HMGET', k, 'st', 'fp', 'tk', 'at', 'ea', 'lu', 'ck')
local st = r[1]
if not st then
  local ea = now + tonumber(ARGV[4])
  redis.call('HSET', k, 'st', 'processing', 'fp', fp, 'tk', token, 'at', 1, 'ck', 'new',
    'ca', now, 'ua', now, 'ea', ea, 'lu', lu)
  redis.call('PEXPIREAT', k, math.max(ea, lu))
  return {1, 1, 'new', ea - now}
end
-- This very claim, sent again after its answer was lost: it won then.
if r[3] == token and st == 'processing' then
  return {1, tonumber(r[4]), r[7], math.max(tonumber(r[5]) - now, 0)}
end
local old_ea, old_lu = tonumber(r[5]), tonumber(r[6])
local expired = old_ea <= now
local running = st == 'processing' and old_lu > now
local same = r[2] == fp
if (expired and not running) or (same and (st == 'failed' or (st == 'processing' and not running))) then
  local at, ck, ea
  if expired then
    at, ck, ea = 1, 'new', now + tonumber(ARGV[4])
    redis.call('HSET', k, 'ca', now)
  else
    at, ea = tonumber(r[4]) + 1, math.max(old_ea, lu)
    if st == 'failed' then ck = 'retry' else ck = 'takeover' end
  end
  redis.call('HDEL', k, 'rs', 'rh', 'rb', 'br')
  redis.call('HSET', k, 'st', 'processing', 'fp', fp, 'tk', token, 'at', at, 'ck', ck,
    'ua', now, 'ea', ea, 'lu', lu)
  redis.call('PEXPIREAT', k, math.max(ea, lu))
  return {1, at, ck, ea - now}
end
local h = redis.call('HMGET', k, 'rs', 'rh', 'rb', 'br')
local same_flag = 0
if same then same_flag = 1 end
return {0, st, same_flag, r[3], math.max(old_lu - now, 0), math.max(old_ea - now, 0), h[1], h[2], h[3], h[4]}
