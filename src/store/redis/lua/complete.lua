-- Stores the response. Fenced: only the claim holding the record's token, while it is processing. The
-- record then expires (Redis TTL) at its expiry.
-- KEYS[1]: the record. ARGV: token, response status, headers, body retained (0/1), body (when retained).
-- Returns 1 when stored (also when this completion is sent again after its answer was lost), else 0.
-- One write when it can be: what reaches the AOF and the replicas is then one HSET, not a transaction.
local k = KEYS[1]
local r = redis.call('HMGET', k, 'st', 'tk', 'ea', 'lu')
if r[2] ~= ARGV[1] then return 0 end
if r[1] == 'completed' then return 1 end
if r[1] ~= 'processing' then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- A completed record's lease ended when it completed: its 'ua' says when ('lu' is a running claim's).
if ARGV[4] == '1' then
  redis.call('HSET', k, 'st', 'completed', 'ua', now, 'rs', ARGV[2], 'rh', ARGV[3], 'br', '1', 'rb', ARGV[5])
else
  redis.call('HSET', k, 'st', 'completed', 'ua', now, 'rs', ARGV[2], 'rh', ARGV[3], 'br', '0')
end
-- The TTL is already the expiry unless the lease ran past it (a heartbeat or a takeover moves the expiry
-- to the lease end; a new claim's TTL is the later of the two).
local ea = tonumber(r[3])
if tonumber(r[4]) > ea then redis.call('PEXPIREAT', k, ea) end
return 1
