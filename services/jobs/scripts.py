"""Lua scripts for the batch state machine: each runs atomically inside Redis.

Status flow: validating -> in_progress -> finalizing -> completed; validating -> failed; validating |
in_progress -> cancelling -> cancelled; validating | in_progress -> expired. The first script that sets
`finalize_to` decides the terminal status and queues the one `finalize` task; `frozen` (set by FREEZE)
stops item results from being accepted, so the counts and the output files agree.
"""
from __future__ import annotations

# KEYS: file, file users, batch, batches, deadlines, control. ARGV: batch id, expires_at, field, value, ...
CREATE_BATCH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 'missing' end
local purpose = redis.call('HGET', KEYS[1], 'purpose')
if purpose ~= 'batch' then return 'purpose:' .. tostring(purpose) end
local fields = {}
for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[3], unpack(fields))
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[4], 0, ARGV[1])
redis.call('ZADD', KEYS[5], ARGV[2], ARGV[1])
redis.call('XADD', KEYS[6], '*', 'op', 'validate', 'batch', ARGV[1])
return 'ok'
"""

# KEYS: batch, control. ARGV: batch id, now.
CANCEL_BATCH = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 'missing' end
if st == 'cancelling' or st == 'cancelled' then return st end
if (st == 'validating' or st == 'in_progress') and redis.call('HSETNX', KEYS[1], 'finalize_to', 'cancelled') == 1 then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[2])
  redis.call('XADD', KEYS[2], '*', 'op', 'finalize', 'batch', ARGV[1])
  return 'cancelling'
end
local to = redis.call('HGET', KEYS[1], 'finalize_to')
if to and st ~= to then return 'conflict:' .. st .. ' (finalizing as ' .. to .. ')' end
return 'conflict:' .. st
"""

# KEYS: file, content, users, files. ARGV: file id.
DELETE_FILE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 'missing' end
local users = redis.call('SRANDMEMBER', KEYS[3])
if users then return 'in_use:' .. users end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('ZREM', KEYS[4], ARGV[1])
return 'ok'
"""

# Record one item's result exactly once (keyed by custom_id) and acknowledge its stream entry.
# KEYS: batch, out, err, items, control. ARGV: custom_id, value, ok (1|0), entry id, group, now, batch id.
# Returns 1 when recorded, 0 when dropped (already recorded, or the batch no longer accepts results).
RECORD_RESULT = """
local recorded = 0
local st = redis.call('HGET', KEYS[1], 'status')
if (st == 'in_progress' or st == 'cancelling') and redis.call('HEXISTS', KEYS[1], 'frozen') == 0 then
  if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 and redis.call('HEXISTS', KEYS[3], ARGV[1]) == 0 then
    redis.call('HSET', ARGV[3] == '1' and KEYS[2] or KEYS[3], ARGV[1], ARGV[2])
    recorded = 1
  end
  local done = redis.call('HLEN', KEYS[2]) + redis.call('HLEN', KEYS[3])
  local total = tonumber(redis.call('HGET', KEYS[1], 'total') or '-1')
  if st == 'in_progress' and done >= total
     and redis.call('HSETNX', KEYS[1], 'finalize_to', 'completed') == 1 then
    redis.call('HSET', KEYS[1], 'status', 'finalizing', 'finalizing_at', ARGV[6])
    redis.call('XADD', KEYS[5], '*', 'op', 'finalize', 'batch', ARGV[7])
  end
end
redis.call('XACK', KEYS[4], ARGV[5], ARGV[4])
redis.call('XDEL', KEYS[4], ARGV[4])
return recorded
"""

# KEYS: batch, deadlines, control. ARGV: batch id. Returns 1 when this call started the expiry.
EXPIRE_BATCH = """
redis.call('ZREM', KEYS[2], ARGV[1])
local st = redis.call('HGET', KEYS[1], 'status')
if (st == 'validating' or st == 'in_progress') and redis.call('HSETNX', KEYS[1], 'finalize_to', 'expired') == 1 then
  redis.call('XADD', KEYS[3], '*', 'op', 'finalize', 'batch', ARGV[1])
  return 1
end
return 0
"""

# Stop accepting results and fix the output file ids (kept across retries of the finalize task).
# KEYS: batch. ARGV: candidate output file id, candidate error file id.
# Returns {finalize_to, output id, error id}, or false when there is nothing (more) to finalize.
FREEZE = """
local st = redis.call('HGET', KEYS[1], 'status')
local to = redis.call('HGET', KEYS[1], 'finalize_to')
if not st or not to or st == 'completed' or st == 'failed' or st == 'expired' or st == 'cancelled' then
  return false
end
redis.call('HSET', KEYS[1], 'frozen', '1')
redis.call('HSETNX', KEYS[1], 'pending_output_file_id', ARGV[1])
redis.call('HSETNX', KEYS[1], 'pending_error_file_id', ARGV[2])
return {to, redis.call('HGET', KEYS[1], 'pending_output_file_id'), redis.call('HGET', KEYS[1], 'pending_error_file_id')}
"""

# Enter the terminal status with final counts and files; release the input file and the per-item results.
# KEYS: batch, file users, deadlines, out, err. ARGV: batch id, now, output file id or '', error file id or ''.
FINISH = """
local st = redis.call('HGET', KEYS[1], 'status')
local to = redis.call('HGET', KEYS[1], 'finalize_to')
if not to or redis.call('HEXISTS', KEYS[1], 'frozen') == 0 or st == to then return 0 end
redis.call('HSET', KEYS[1], 'status', to, to .. '_at', ARGV[2],
           'completed', redis.call('HLEN', KEYS[4]), 'failed', redis.call('HLEN', KEYS[5]))
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'output_file_id', ARGV[3]) end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'error_file_id', ARGV[4]) end
redis.call('HDEL', KEYS[1], 'pending_output_file_id', 'pending_error_file_id')
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[4], KEYS[5])
return 1
"""
