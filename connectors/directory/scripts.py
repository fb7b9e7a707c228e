"""The directory's compare-and-set steps, each one Lua script run atomically by Redis."""

EVENTS_MAXLEN = 16  # an entry changes state at most 3 times

# KEYS[1]: the entry hash, KEYS[2]: its event stream. emit() records a state change; the READY
# event also carries the producer and location, so a waiter has the whole entry without reading it.
LUA_EMIT = f"""
local function emit(state, ttl, producer, location)
  redis.call('PEXPIRE', KEYS[1], ttl)
  if location then
    redis.call('XADD', KEYS[2], 'MAXLEN', '{EVENTS_MAXLEN}', '*', 'state', state, 'producer', producer,
               'location', location)
  else
    redis.call('XADD', KEYS[2], 'MAXLEN', '{EVENTS_MAXLEN}', '*', 'state', state)
  end
  redis.call('PEXPIRE', KEYS[2], ttl)
end
"""
LUA_CREATE = LUA_EMIT + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'state', 'pending', 'producer', ARGV[1], 'reason', '')
emit('pending', ARGV[2])
return 1
"""
# KEYS[3]: the producer's epoch counter; ARGV[4]: the epoch the location names (fencing: a
# producer incarnation older than the latest may not publish).
LUA_PUBLISH = LUA_EMIT + """
local latest = tonumber(redis.call('GET', KEYS[3]) or '0')
if tonumber(ARGV[4]) < latest then return -1 end
local cur = redis.call('HGET', KEYS[1], 'state')
if cur and cur ~= 'pending' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'ready', 'producer', ARGV[1], 'location', ARGV[2], 'reason', '')
emit('ready', ARGV[3], ARGV[1], ARGV[2])
return 1
"""
LUA_TRANSITION = LUA_EMIT + """
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return 0 end
for i = 4, #ARGV do  -- ARGV: to, ttl_ms, reason, allowed_from...
  if ARGV[i] == cur then
    redis.call('HSET', KEYS[1], 'state', ARGV[1], 'reason', ARGV[3])
    emit(ARGV[1], ARGV[2])
    return 1
  end
end
return 0
"""
# KEYS: node record, epoch counter, node index. ARGV: record, epoch, node_ttl_ms, epoch_ttl_ms, node id.
# A counter below the writer's epoch was lost (Redis restarted empty, FLUSHALL): the live node puts its
# epoch back, so the next incarnation still draws a higher one and fencing holds. The index (a sorted set of
# node ids) is what listing nodes reads instead of scanning the keyspace (nodes.py); a member whose record
# has expired is dropped by the next listing.
LUA_PUT_NODE = """
local latest = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[2]) < latest then return {0, latest} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('ZADD', KEYS[3], 0, ARGV[5])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
if tonumber(ARGV[2]) > latest then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[4])
else
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
return {1, latest}
"""

# KEYS: node record, epoch counter, claim. ARGV: claim_ttl_ms, epoch_ttl_ms, what the caller saw of the record
# ("absent", or "draining": a draining record may be replaced). A new incarnation takes its epoch here, and holds
# the claim until it registers (or the claim's TTL ends): a second server starting under the same id at the same
# instant finds the claim, or the registration, and is refused.
LUA_CLAIM_NODE = """
if ARGV[3] == 'absent' and redis.call('EXISTS', KEYS[1]) == 1 then return {0, 0} end
if redis.call('EXISTS', KEYS[3]) == 1 then return {0, 0} end
local epoch = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], epoch, 'PX', ARGV[1])
return {1, epoch}
"""
