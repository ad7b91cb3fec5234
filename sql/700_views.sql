-- pgbroker: the views, the read-only interface for operators, frontends and
-- pgbroker_reader.  Tables are not an interface; these are.  Rows about a
-- name show only to roles that may read it by the name grants
-- (050_authority.sql): each view filters with name_allowed(), called only
-- when the kind has grants (else every name is readable, and the test costs
-- the view one probe, not a call per row), and tested before anything else
-- is computed for the row (a CASE or the WHERE of a subquery fenced by
-- OFFSET 0, since the functions it guards refuse names one may not read).
-- A broker's
-- clients, subscriptions, state and outbox are shown for the lease's current
-- epoch only: what earlier epochs left is invisible (sweep_backlog counts it).

-- ---------------------------------------------------------------------------
-- Views for operators and frontends.

CREATE VIEW pgbroker.brokers AS
SELECT l.name,
       l.epoch,
       l.state,
       l.holder_pid,
       l.holder_application,
       l.holder_address,
       l.holder_user,
       l.holder_info,
       l.claimed_at,
       l.heartbeat_at,
       pg_catalog.clock_timestamp() - l.heartbeat_at AS heartbeat_age,
       l.released_at,
       pgbroker.broker_alive(l.name) AS alive,
       -- 1885823602 is pgbroker._lock_class(), written out: readers of a view may not run internal functions.
       (SELECT count(*) FROM pg_catalog.pg_locks w
         WHERE w.locktype = 'advisory' AND NOT w.granted
           AND w.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())
           AND w.classid = 1885823602::oid AND w.objid = l.lock_key::oid AND w.objsubid = 2)::integer AS waiting
  FROM pgbroker.lease l
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
        OR pgbroker.name_allowed('lease', l.name));
COMMENT ON VIEW pgbroker.brokers IS 'One row per lease name: its epoch, holder and whether the holder is alive.';
COMMENT ON COLUMN pgbroker.brokers.name IS 'Lease name.';
COMMENT ON COLUMN pgbroker.brokers.epoch IS 'Current epoch (fencing token); 0 before the first claim.';
COMMENT ON COLUMN pgbroker.brokers.state IS 'new, held, released or expired (a TTL lease that lapsed, once noticed).';
COMMENT ON COLUMN pgbroker.brokers.holder_pid IS 'Backend pid of the holder (of the last holder when not alive).';
COMMENT ON COLUMN pgbroker.brokers.holder_application IS 'application_name of the holder at claim time.';
COMMENT ON COLUMN pgbroker.brokers.holder_address IS 'Client address of the holder; NULL over a Unix socket.';
COMMENT ON COLUMN pgbroker.brokers.holder_user IS 'Database user of the holder.';
COMMENT ON COLUMN pgbroker.brokers.holder_info IS 'Free text the holder gave when claiming (info =>).';
COMMENT ON COLUMN pgbroker.brokers.claimed_at IS 'When the current epoch was claimed.';
COMMENT ON COLUMN pgbroker.brokers.heartbeat_at IS 'Last heartbeat of the holder.';
COMMENT ON COLUMN pgbroker.brokers.heartbeat_age IS 'How long ago that was.';
COMMENT ON COLUMN pgbroker.brokers.released_at IS 'When the holder released the lease, if it did.';
COMMENT ON COLUMN pgbroker.brokers.alive IS 'True when the recorded holder''s backend exists and holds the lock.';
COMMENT ON COLUMN pgbroker.brokers.waiting IS 'Number of sessions blocked in broker_claim() for this lease.';

CREATE VIEW pgbroker.lease_history AS
SELECT id, name, epoch, event, at, pid, db_user, application, address, info,
       previous_epoch, previous_pid, previous_application, previous_address, previous_heartbeat_at, reason
  FROM pgbroker.lease_event
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
        OR pgbroker.name_allowed('lease', name));
COMMENT ON VIEW pgbroker.lease_history IS 'Every claim, takeover, release and expiry, oldest first by id: who took the lease from whom, when and why. Each was announced on lease_channel() as it committed.';
COMMENT ON COLUMN pgbroker.lease_history.id IS 'Increasing event number.';
COMMENT ON COLUMN pgbroker.lease_history.name IS 'Lease name.';
COMMENT ON COLUMN pgbroker.lease_history.epoch IS 'Epoch claimed or released.';
COMMENT ON COLUMN pgbroker.lease_history.event IS 'claim, takeover, stale_takeover, release or expired.';
COMMENT ON COLUMN pgbroker.lease_history.at IS 'When it happened (clock time inside the claiming transaction).';
COMMENT ON COLUMN pgbroker.lease_history.pid IS 'Backend pid of the session that acted.';
COMMENT ON COLUMN pgbroker.lease_history.db_user IS 'Database user (session_user) that acted.';
COMMENT ON COLUMN pgbroker.lease_history.application IS 'Its application_name.';
COMMENT ON COLUMN pgbroker.lease_history.address IS 'Its client address.';
COMMENT ON COLUMN pgbroker.lease_history.info IS 'The info text given to broker_claim().';
COMMENT ON COLUMN pgbroker.lease_history.previous_epoch IS 'For a claim: the epoch it replaced.';
COMMENT ON COLUMN pgbroker.lease_history.previous_pid IS 'For a claim: the previous holder''s pid.';
COMMENT ON COLUMN pgbroker.lease_history.previous_application IS 'For a claim: the previous holder''s application_name.';
COMMENT ON COLUMN pgbroker.lease_history.previous_address IS 'For a claim: the previous holder''s address.';
COMMENT ON COLUMN pgbroker.lease_history.previous_heartbeat_at IS 'For a claim: the previous holder''s last heartbeat.';
COMMENT ON COLUMN pgbroker.lease_history.reason IS 'Why, in words.';

CREATE VIEW pgbroker.broker_state AS
SELECT s.name, s.epoch, s.key, s.value, s.updated_at
  FROM pgbroker.state s
  JOIN pgbroker.lease l ON l.name = s.name AND l.epoch = s.epoch
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
        OR pgbroker.name_allowed('lease', s.name));
COMMENT ON VIEW pgbroker.broker_state IS 'Key/value state published by the current broker of each lease.';
COMMENT ON COLUMN pgbroker.broker_state.name IS 'Lease name.';
COMMENT ON COLUMN pgbroker.broker_state.epoch IS 'Epoch of the broker that wrote it.';
COMMENT ON COLUMN pgbroker.broker_state.key IS 'Key.';
COMMENT ON COLUMN pgbroker.broker_state.value IS 'Value.';
COMMENT ON COLUMN pgbroker.broker_state.updated_at IS 'When it was last set.';

-- ---------------------------------------------------------------------------
-- Views.

CREATE VIEW pgbroker.watched_tables AS
SELECT w.relid::regclass AS "table", w.key_columns, w.mode, w.watched_at,
       (SELECT count(*) FROM pgbroker.subscription s
          JOIN pgbroker.client c ON c.client_key = s.client_key
          JOIN pgbroker.lease l ON l.name = c.name AND l.epoch = c.epoch
         WHERE s.watch_id = w.watch_id) AS subscriptions
  FROM pgbroker.watched w;
COMMENT ON VIEW pgbroker.watched_tables IS 'Tables watched by pgbroker, with their key columns, trigger mode and number of subscriptions.';
COMMENT ON COLUMN pgbroker.watched_tables."table" IS 'The watched table.';
COMMENT ON COLUMN pgbroker.watched_tables.key_columns IS 'Its primary-key columns, in the order used by key encoding.';
COMMENT ON COLUMN pgbroker.watched_tables.mode IS 'How its triggers fire: statement (once per statement, with transition tables) or row (once per changed row); see watch().';
COMMENT ON COLUMN pgbroker.watched_tables.watched_at IS 'When watch() last installed its triggers.';
COMMENT ON COLUMN pgbroker.watched_tables.subscriptions IS 'Number of subscriptions to it (of the brokers'' current epochs).';

CREATE VIEW pgbroker.subscriptions AS
SELECT c.name, c.client_id, w.relid::regclass AS "table",
       CASE WHEN jsonb_typeof(s.row_key) NOT IN ('null', 'object') THEN s.row_key END AS key, s.subscribed_at,
       -- A filter's points are keys that are JSON objects (350_filters.sql), which no row's key is; a range's
       -- member "" is for the index.
       CASE WHEN jsonb_typeof(s.row_key) = 'object' THEN s.row_key - '' END AS filter
  FROM (SELECT l.name, l.epoch FROM pgbroker.lease l
         WHERE CASE WHEN (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
                          OR pgbroker.name_allowed('lease', l.name)) THEN pgbroker.broker_alive(l.name) END
        OFFSET 0) l  -- once per lease
  JOIN pgbroker.client c ON c.name = l.name AND c.epoch = l.epoch
  JOIN pgbroker.subscription s ON s.client_key = c.client_key
  JOIN pgbroker.watched w ON w.watch_id = s.watch_id;
COMMENT ON VIEW pgbroker.subscriptions IS 'Who is subscribed to what: the clients of live brokers, as in the view clients.';
COMMENT ON COLUMN pgbroker.subscriptions.name IS 'Broker (lease name) of the client.';
COMMENT ON COLUMN pgbroker.subscriptions.client_id IS 'The client.';
COMMENT ON COLUMN pgbroker.subscriptions."table" IS 'The watched table.';
COMMENT ON COLUMN pgbroker.subscriptions.key IS 'The row key (jsonb), NULL for a whole-table subscription or one by filter.';
COMMENT ON COLUMN pgbroker.subscriptions.subscribed_at IS 'When.';
COMMENT ON COLUMN pgbroker.subscriptions.filter IS 'For a subscription by filter: one point of the filter, a JSON object of column values and at most one range ({"team": 7, "price": {"gte": 10}}; a filter with "in" has a row per value); NULL otherwise.';

CREATE VIEW pgbroker.outbox_pending AS
SELECT o.name, count(*) AS pending, min(o.at) AS oldest
  FROM pgbroker.outbox o
  JOIN pgbroker.lease l ON l.name = o.name AND l.epoch = o.epoch
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
        OR pgbroker.name_allowed('lease', o.name))
 GROUP BY o.name;
COMMENT ON VIEW pgbroker.outbox_pending IS 'Undelivered notifications per broker (of its current epoch): how many and since when.';
COMMENT ON COLUMN pgbroker.outbox_pending.name IS 'Broker (lease name).';
COMMENT ON COLUMN pgbroker.outbox_pending.pending IS 'Notifications not yet acknowledged.';
COMMENT ON COLUMN pgbroker.outbox_pending.oldest IS 'Statement time of the oldest one.';

CREATE VIEW pgbroker.clients AS
SELECT c.name, c.epoch, c.client_id, c.info, c.registered_at, c.updated_at,
       (SELECT count(*) FROM pgbroker.subscription s WHERE s.client_key = c.client_key)::integer AS subscriptions
  FROM (SELECT l.name, l.epoch FROM pgbroker.lease l
         WHERE CASE WHEN (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
                          OR pgbroker.name_allowed('lease', l.name)) THEN pgbroker.broker_alive(l.name) END
        OFFSET 0) l  -- once per lease
  JOIN pgbroker.client c ON c.name = l.name AND c.epoch = l.epoch;
COMMENT ON VIEW pgbroker.clients IS 'Clients connected to live brokers, with their broker (lease name) and epoch.';
COMMENT ON COLUMN pgbroker.clients.name IS 'Lease name of the broker the client is connected to.';
COMMENT ON COLUMN pgbroker.clients.epoch IS 'Epoch of that broker.';
COMMENT ON COLUMN pgbroker.clients.client_id IS 'Client identifier given by the broker.';
COMMENT ON COLUMN pgbroker.clients.info IS 'What the broker knows of the client (address, version...).';
COMMENT ON COLUMN pgbroker.clients.registered_at IS 'When it was registered.';
COMMENT ON COLUMN pgbroker.clients.updated_at IS 'When its info last changed.';
COMMENT ON COLUMN pgbroker.clients.subscriptions IS 'How many subscriptions it has.';

CREATE VIEW pgbroker.sweep_backlog AS
SELECT l.name, l.epoch,
       (SELECT count(*) FROM pgbroker.client c WHERE c.name = l.name AND c.epoch < l.epoch) AS clients,
       (SELECT count(*) FROM pgbroker.client c JOIN pgbroker.subscription s ON s.client_key = c.client_key
         WHERE c.name = l.name AND c.epoch < l.epoch) AS subscriptions,
       (SELECT count(*) FROM pgbroker.interest i WHERE i.name = l.name AND i.epoch < l.epoch) AS interest,
       (SELECT count(*) FROM pgbroker.outbox o WHERE o.name = l.name AND o.epoch < l.epoch) AS outbox,
       (SELECT count(*) FROM pgbroker.state s WHERE s.name = l.name AND s.epoch < l.epoch) AS state
  FROM pgbroker.lease l
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
        OR pgbroker.name_allowed('lease', l.name));
COMMENT ON VIEW pgbroker.sweep_backlog IS
    'Per lease: the rows its earlier epochs left that broker_sweep() has yet to delete (invisible everywhere else; they only take space).';
COMMENT ON COLUMN pgbroker.sweep_backlog.name IS 'Lease name.';
COMMENT ON COLUMN pgbroker.sweep_backlog.epoch IS 'Its current epoch.';
COMMENT ON COLUMN pgbroker.sweep_backlog.clients IS 'Clients of earlier epochs.';
COMMENT ON COLUMN pgbroker.sweep_backlog.subscriptions IS 'Their subscriptions.';
COMMENT ON COLUMN pgbroker.sweep_backlog.interest IS 'Interest rows of earlier epochs (what the triggers read).';
COMMENT ON COLUMN pgbroker.sweep_backlog.outbox IS 'Notifications of earlier epochs, never to be fetched.';
COMMENT ON COLUMN pgbroker.sweep_backlog.state IS 'Broker state rows of earlier epochs.';

-- ---------------------------------------------------------------------------
-- The coordination primitives.  pg_stat_activity shows other roles' sessions
-- (application_name, backend_start) only to roles with pg_read_all_stats:
-- without it, application and holder_since are NULL for them.  Who holds
-- what comes from pg_locks, which every role sees whole.

CREATE VIEW pgbroker.locks AS
SELECT n.name,
       CASE WHEN l.mode = 'ExclusiveLock' THEN 'exclusive' ELSE 'shared' END AS mode,
       l.pid AS holder_pid,
       a.application_name AS application,
       a.backend_start AS holder_since,
       (SELECT count(*) FROM pg_catalog.pg_locks w
         WHERE w.locktype = 'advisory' AND NOT w.granted AND w.database = l.database
           AND w.classid = l.classid AND w.objid = l.objid AND w.objsubid = 2)::integer AS waiting,
       (SELECT min(w.waitstart) FROM pg_catalog.pg_locks w
         WHERE w.locktype = 'advisory' AND NOT w.granted AND w.database = l.database
           AND w.classid = l.classid AND w.objid = l.objid AND w.objsubid = 2) AS waiting_since
  FROM pg_catalog.pg_locks l
  JOIN pgbroker.lock_name n ON n.key = l.objid::integer
  LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
   AND l.classid = 1885823596::oid   -- named locks ('pgbl')
   AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())
   AND (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lock')
        OR pgbroker.name_allowed('lock', n.name));
COMMENT ON VIEW pgbroker.locks IS 'Named locks held now: one row per holder and mode, with how many sessions wait for the lock.';
COMMENT ON COLUMN pgbroker.locks.name IS 'Lock name.';
COMMENT ON COLUMN pgbroker.locks.mode IS 'exclusive or shared.';
COMMENT ON COLUMN pgbroker.locks.holder_pid IS 'Backend pid of a holder.';
COMMENT ON COLUMN pgbroker.locks.application IS 'Its application_name (NULL for other roles'' sessions without pg_read_all_stats).';
COMMENT ON COLUMN pgbroker.locks.holder_since IS 'When the holder''s session started (PostgreSQL does not record when an advisory lock was granted); NULL for other roles'' sessions without pg_read_all_stats.';
COMMENT ON COLUMN pgbroker.locks.waiting IS 'Sessions blocked in lock_acquire() for this lock.';
COMMENT ON COLUMN pgbroker.locks.waiting_since IS 'Since when the longest of them has waited.';

CREATE VIEW pgbroker.semaphores AS
SELECT p.name,
       max(p.permit) AS permits,
       count(l.pid)::integer AS held,
       array_agg(l.pid ORDER BY p.permit) FILTER (WHERE l.pid IS NOT NULL) AS holders,
       (SELECT count(DISTINCT w.pid) FROM pg_catalog.pg_locks w
          JOIN pgbroker.semaphore_permit q ON q.key = w.objid::integer AND q.name = p.name
         WHERE w.locktype = 'advisory' AND NOT w.granted AND w.objsubid = 2
           AND w.classid = 1885823597::oid
           AND w.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())
       )::integer AS waiting
  FROM pgbroker.semaphore_permit p
  LEFT JOIN pg_catalog.pg_locks l
    ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
   AND l.classid = 1885823597::oid   -- semaphore permits ('pgbm')
   AND l.objid = p.key::oid
   AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'semaphore')
        OR pgbroker.name_allowed('semaphore', p.name))
 GROUP BY p.name;
COMMENT ON VIEW pgbroker.semaphores IS 'Semaphores: how many permits exist, how many are held and by whom.';
COMMENT ON COLUMN pgbroker.semaphores.name IS 'Semaphore name.';
COMMENT ON COLUMN pgbroker.semaphores.permits IS 'The largest limit it has been used with.';
COMMENT ON COLUMN pgbroker.semaphores.held IS 'Permits held now.';
COMMENT ON COLUMN pgbroker.semaphores.holders IS 'Backend pids of the holders, by permit number.';
COMMENT ON COLUMN pgbroker.semaphores.waiting IS 'Sessions blocked in semaphore_acquire() (waiters that LISTEN are not counted).';

CREATE VIEW pgbroker.kv AS
SELECT e.key, e.version, e.updated_at, e.expires_at,
       CASE WHEN pg_catalog.pg_has_role(current_user, 'pgbroker_user', 'MEMBER')
                 OR pg_catalog.pg_has_role(current_user, 'pgbroker_admin', 'MEMBER') THEN e.value END AS value
  FROM pgbroker.kv_entry e
 WHERE (e.expires_at IS NULL OR e.expires_at > pg_catalog.clock_timestamp())
   AND (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'kv') OR pgbroker.name_allowed('kv', e.key));
COMMENT ON VIEW pgbroker.kv IS 'Live entries of the key-value store; values only to members of pgbroker_user or pgbroker_admin.';
COMMENT ON COLUMN pgbroker.kv.key IS 'The key.';
COMMENT ON COLUMN pgbroker.kv.version IS 'Version of its last change.';
COMMENT ON COLUMN pgbroker.kv.updated_at IS 'When it last changed.';
COMMENT ON COLUMN pgbroker.kv.expires_at IS 'When it expires (NULL: never).';
COMMENT ON COLUMN pgbroker.kv.value IS 'Its value, for members of pgbroker_user (NULL for other readers).';

CREATE VIEW pgbroker.counters AS
SELECT c.name, c.value, c.updated_at FROM pgbroker.counter c
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'counter')
        OR pgbroker.name_allowed('counter', c.name));
COMMENT ON VIEW pgbroker.counters IS 'Atomic counters and their values.';
COMMENT ON COLUMN pgbroker.counters.name IS 'Counter name.';
COMMENT ON COLUMN pgbroker.counters.value IS 'Its value.';
COMMENT ON COLUMN pgbroker.counters.updated_at IS 'When it last changed.';

CREATE VIEW pgbroker.rate_limits AS
SELECT s.name, s.rate, s.per, s.burst,
       greatest(0, least(s.burst, pg_catalog.div(c.now + s.burst * c.t - s.tat, c.t)))::integer AS available,
       CASE WHEN s.tat <= c.now THEN NULL
            WHEN s.tat < 8000000000000000000000000000   -- 253,000 years after 1970; later ones overflow a timestamptz
            THEN pg_catalog.to_timestamp(s.tat / 1000000000000000)
            ELSE timestamptz 'infinity' END AS full_at,
       s.allowed, s.denied, s.last_allowed, s.updated_at
  FROM pgbroker.rate_limit_state s
 CROSS JOIN LATERAL (SELECT EXTRACT(epoch FROM pg_catalog.clock_timestamp()) * 1000000000000000 AS now,
                            -- pgbroker._rate_limit_interval(), written out: a view's readers would need
                            -- EXECUTE on a function it calls, and internal functions are granted to nobody
                            pg_catalog.div(EXTRACT(epoch FROM s.per) * 1000000000000000 + s.rate - 1,
                                           s.rate::numeric) AS t) c
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'rate_limit')
        OR pgbroker.name_allowed('rate_limit', s.name));
COMMENT ON VIEW pgbroker.rate_limits IS
    'Rate limits (rate_limit()) with the parameters of their last call: how much is available now, when they are full again, and how many calls were allowed and denied. A crash forgets them all.';
COMMENT ON COLUMN pgbroker.rate_limits.name IS 'Rate limit name.';
COMMENT ON COLUMN pgbroker.rate_limits.rate IS 'RATE of the last call.';
COMMENT ON COLUMN pgbroker.rate_limits.per IS 'PER of the last call.';
COMMENT ON COLUMN pgbroker.rate_limits.burst IS 'BURST of the last call (RATE when it passed NULL).';
COMMENT ON COLUMN pgbroker.rate_limits.available IS 'Calls of cost 1 that would be allowed now, with those parameters (0 to burst).';
COMMENT ON COLUMN pgbroker.rate_limits.full_at IS 'When all of BURST is available again; NULL when it is now.';
COMMENT ON COLUMN pgbroker.rate_limits.allowed IS 'Calls allowed since the name was first used (or since a crash).';
COMMENT ON COLUMN pgbroker.rate_limits.denied IS 'Calls denied since then.';
COMMENT ON COLUMN pgbroker.rate_limits.last_allowed IS 'Whether the last call was allowed.';
COMMENT ON COLUMN pgbroker.rate_limits.updated_at IS 'When the last call was decided.';

-- ---------------------------------------------------------------------------
-- Authority per name (050_authority.sql).

CREATE VIEW pgbroker.name_grants AS
SELECT g.kind, g.prefix, g.role::regrole AS role, g.rights, g.granted_at
  FROM pgbroker.name_grant g;
COMMENT ON VIEW pgbroker.name_grants IS
    'Name grants: which role may read or write the names of a kind that begin with a prefix; a name that no prefix covers is anyone''s with the capability role.';
COMMENT ON COLUMN pgbroker.name_grants.kind IS 'lease, lock, semaphore, kv, counter or rate_limit.';
COMMENT ON COLUMN pgbroker.name_grants.prefix IS 'The names it covers begin with this ('''' covers every name).';
COMMENT ON COLUMN pgbroker.name_grants.role IS 'The role granted (an oid, shown as a number, once the role is dropped: it then admits nobody).';
COMMENT ON COLUMN pgbroker.name_grants.rights IS 'read, or write (which implies read).';
COMMENT ON COLUMN pgbroker.name_grants.granted_at IS 'When it was granted or last changed.';

CREATE VIEW pgbroker.name_grants_version AS
SELECT v.version, ARRAY(SELECT k.kind FROM pgbroker.name_grant_kind k ORDER BY k.kind) AS kinds
  FROM pgbroker.name_grant_version v;
COMMENT ON VIEW pgbroker.name_grants_version IS
    'A number that changes with every name_grant and name_revoke, and the kinds with grants: what a client caches about a name of a kind without grants stays valid while the number is unchanged (the Python Lock takes a lock by its cached key only then).';
COMMENT ON COLUMN pgbroker.name_grants_version.version IS 'Grows with every grant and revoke, and with every maintain() that finds lock names idle (a cached lock key is valid while it is unchanged).';
COMMENT ON COLUMN pgbroker.name_grants_version.kinds IS 'The kinds some grant covers names of (their names are checked at every call, role memberships included).';
