-- Stores the response. Fenced: only the claim holding the record's token, while it is processing. The
-- record then expires (Redis TTL) at its expiry.
-- KEYS[1]: the record. ARGV: token, response status, headers, body retained (0/1), body (when retained).
-- Returns 1 when stored (also when this completion is sent again after its answer was lost), else 0.
local k = KEYS[1]
local r = redis.call('HMGET', k, 'st', 'tk', 'ea')
if r[2] ~= ARGV[1] then return 0 end
if r[1] == 'completed' then return 1 end
if r[1] ~= 'processing' then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', k, 'st', 'completed', 'lu', now, 'ua', now, 'rs', ARGV[2], 'rh', ARGV[3], 'br', ARGV[4])
if ARGV[4] == '1' then redis.call('HSET', k, 'rb', ARGV[5]) end
redis.call('PEXPIREAT', k, tonumber(r[3]))
return 1
