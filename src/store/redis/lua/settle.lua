-- Ends a claim without a response: the holder releases it ('failed', the next retry executes) or holds
-- it ('unknown', refused until an operator releases it); an operator releases a claim whose lease ran
-- out, or a held record ('stale'). Fenced by the token. The record then expires (Redis TTL) at its expiry.
-- KEYS[1]: the record. ARGV: token, new status, 'holder' or 'stale'. Returns 1 when settled, else 0.
local k = KEYS[1]
local r = redis.call('HMGET', k, 'st', 'tk', 'ea', 'lu')
if r[2] ~= ARGV[1] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local st = r[1]
if ARGV[3] == 'holder' then
  -- This very settlement, sent again after its answer was lost.
  if st == ARGV[2] then return 1 end
  if st ~= 'processing' then return 0 end
elseif not (st == 'unknown' or (st == 'processing' and tonumber(r[4]) <= now)) then
  return 0
end
redis.call('HSET', k, 'st', ARGV[2], 'lu', now, 'ua', now)
redis.call('PEXPIREAT', k, tonumber(r[3]))
return 1
