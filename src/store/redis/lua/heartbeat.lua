-- Extends the lease, and the expiry with it so a running key never expires. Fenced by the token.
-- KEYS[1]: the record. ARGV: token, lease (ms). Returns 1 when extended, 0 when fenced out.
local k = KEYS[1]
local r = redis.call('HMGET', k, 'st', 'tk', 'ea')
if r[1] ~= 'processing' or r[2] ~= ARGV[1] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lu = now + tonumber(ARGV[2])
local ea = math.max(tonumber(r[3]), lu)
redis.call('HSET', k, 'lu', lu, 'ea', ea, 'ua', now)
redis.call('PEXPIREAT', k, ea)
return 1
