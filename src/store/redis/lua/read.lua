-- An operator's view of one record, with the node's clock; the body is described by its size only.
-- KEYS[1]: the record. Returns {now (ms), status, attempt, claim kind, token, created, updated, expires,
-- lease end, response status, body retained, body size}, or {now} when there is no record.
local k = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local r = redis.call('HMGET', k, 'st', 'at', 'ck', 'tk', 'ca', 'ua', 'ea', 'lu', 'rs', 'br')
if not r[1] then return {now} end
-- A completed record's lease ended when it completed ('ua').
if r[1] == 'completed' then r[8] = r[6] end
return {now, r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], redis.call('HSTRLEN', k, 'rb')}
