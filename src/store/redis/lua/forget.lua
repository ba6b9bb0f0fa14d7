-- `keys forget`: deletes a record, fenced by the token the operator was shown, so a record claimed again
-- since then (a new execution under way) is kept.
-- KEYS[1]: the record. ARGV: token. Returns 1 when deleted, else 0.
local k = KEYS[1]
if redis.call('HGET', k, 'tk') ~= ARGV[1] then return 0 end
return redis.call('DEL', k)
