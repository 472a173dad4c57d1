"""Lua scripts for the batch state machine and for files with their storage quota: each runs atomically inside
Redis.

Status flow: validating -> in_progress -> finalizing -> completed; validating -> failed; validating |
in_progress -> cancelling -> cancelled; validating | in_progress -> expired. The first script that sets
`finalize_to` decides the terminal status and queues the one `finalize` task; `frozen` (set by FREEZE)
stops item results from being accepted, so the counts and the output files agree.
"""
from __future__ import annotations

# KEYS: file, file users, batch, batches, deadlines, control. ARGV: batch id, expires_at, now, most unfinished
# batches (0: no limit), field, value, ... `deadlines` holds exactly the unfinished batches.
CREATE_BATCH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 'missing' end
local file_expires = tonumber(redis.call('HGET', KEYS[1], 'expires_at') or '')
if file_expires and file_expires <= tonumber(ARGV[3]) then return 'missing' end
local purpose = redis.call('HGET', KEYS[1], 'purpose')
if purpose ~= 'batch' then return 'purpose:' .. tostring(purpose) end
local most = tonumber(ARGV[4])
if most > 0 and redis.call('ZCARD', KEYS[5]) >= most then return 'busy' end
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
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

# ---------------------------------------------------------------- files and the storage quota
# `usage` counts the bytes of every stored file plus those written so far by unfinished writers (`reserved`,
# file id -> bytes; `uploads`, file id -> when an abandoned writer's bytes are released). Every script below
# keeps `usage` equal to that sum, so the quota check in PUSH_CHUNK is exact.

# Remove a file (DELETE, or the expiry sweep). KEYS: file, content, users, files, usage, expiries.
# ARGV: file id, now, sweep ('1': only if it has expired). Returns 'missing', 'live' (sweep: not expired yet),
# 'in_use:{batch id}', 'deleted', or 'expired' (it had expired: gone for clients; its bytes are freed now, or
# once the batch that still reads it ends).
DELETE_FILE = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('ZREM', KEYS[6], ARGV[1])
  return 'missing'
end
local at = tonumber(redis.call('HGET', KEYS[1], 'expires_at') or '')
local expired = at ~= nil and at <= tonumber(ARGV[2])
if ARGV[3] == '1' and not expired then return 'live' end
local users = redis.call('SRANDMEMBER', KEYS[3])
if users then
  if not expired then return 'in_use:' .. users end
  redis.call('ZADD', KEYS[6], tonumber(ARGV[2]) + 60, ARGV[1])  -- look again in a minute
  return 'expired'
end
redis.call('DECRBY', KEYS[5], tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0'))
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[6], ARGV[1])
return expired and 'expired' or 'deleted'
"""

# Append one chunk to an unfinished file, counting it against the quota first.
# KEYS: usage, reserved, uploads, upload. ARGV: file id, chunk, quota (0: counted, never refused), release
# deadline, key TTL. Returns {1, usage} when stored, {0, usage} (nothing stored) when it would pass the quota.
PUSH_CHUNK = """
local n = string.len(ARGV[2])
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local quota = tonumber(ARGV[3])
if quota > 0 and used + n > quota then return {0, used} end
redis.call('INCRBY', KEYS[1], n)
redis.call('HINCRBY', KEYS[2], ARGV[1], n)
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
redis.call('RPUSH', KEYS[4], ARGV[2])
redis.call('EXPIRE', KEYS[4], ARGV[5])
return {1, used + n}
"""

# Drop what an unfinished writer wrote and give its bytes back. KEYS: usage, reserved, uploads, upload.
# ARGV: file id, not_after ('': always; else only if its release deadline is at or before it: the sweep).
# Returns the bytes released, or -1 when the writer is still live.
RELEASE_UPLOAD = """
if ARGV[2] ~= '' and tonumber(redis.call('ZSCORE', KEYS[3], ARGV[1]) or '0') > tonumber(ARGV[2]) then
  return -1
end
local n = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
redis.call('DECRBY', KEYS[1], n)
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[4])
return n
"""

# The written chunks become the file, with its object, in one step; their bytes stay counted, now as the
# file's. A file committed again (a finalize re-run after a crash) replaces itself: its old bytes are freed.
# KEYS: usage, reserved, uploads, upload, content, file, files, expiries.
# ARGV: file id, expires_at ('' for none), most files (0: no limit), field, value, ... Returns 0 when nothing was
# written (released), -1 when `files` already holds the most files (the upload stays to be released).
COMMIT_FILE = """
if redis.call('EXISTS', KEYS[4]) == 0 then return 0 end
local most = tonumber(ARGV[3])
if most > 0 and redis.call('ZCARD', KEYS[7]) >= most then return -1 end
redis.call('DECRBY', KEYS[1], tonumber(redis.call('HGET', KEYS[6], 'bytes') or '0'))
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('RENAME', KEYS[4], KEYS[5])
redis.call('PERSIST', KEYS[5])
redis.call('DEL', KEYS[6])
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[6], unpack(fields))
redis.call('ZADD', KEYS[7], 0, ARGV[1])
if ARGV[2] ~= '' then redis.call('ZADD', KEYS[8], ARGV[2], ARGV[1]) else redis.call('ZREM', KEYS[8], ARGV[1]) end
return 1
"""

# Start counting `usage` where Redis holds files stored before it was kept. KEYS: usage, files, reserved.
# ARGV: the file key prefix ("...file:"). Returns the count (whether or not it already existed).
COUNT_USAGE = """
local have = redis.call('GET', KEYS[1])
if have then return tonumber(have) end
local total = 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  total = total + tonumber(redis.call('HGET', ARGV[1] .. id, 'bytes') or '0')
end
for _, n in ipairs(redis.call('HVALS', KEYS[3])) do total = total + tonumber(n) end
redis.call('SET', KEYS[1], total)
return total
"""

# Register a chunk of a batch input file's custom_ids (see unique_ids.py). KEYS: the run's ids hash.
# ARGV: TTL, then (field, line) pairs in line order. Returns {pair number (1-based), first line, ...} for each
# pair whose id was registered before (by an earlier line, of this chunk or an earlier one).
CHECK_IDS = """
local taken = {}
for i = 2, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 0 then
    taken[#taken + 1] = i / 2
    taken[#taken + 1] = redis.call('HGET', KEYS[1], ARGV[i])
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return taken
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
