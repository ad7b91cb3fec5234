-- pgbroker: the singleton broker lease.
--
-- A lease is a named right to be "the" broker.  It is held by a database
-- session through a session-level advisory lock, so it is freed by the server
-- the moment that session ends (process killed, connection lost, server
-- restarted).  The lease row records who holds it and a fencing token, the
-- epoch, which grows with every successful claim and is never reused, not even
-- by a claim that rolled back (epochs come from one sequence, so they may skip
-- values).
--
-- Claims follow their transaction: broker_claim() takes a
-- transaction-level advisory lock, and a deferred constraint trigger turns it
-- into a session-level lock when the transaction commits.  A claim that fails,
-- is cancelled or is rolled back therefore never leaves a lock behind.
--
-- Everything a broker keeps (its state here; its clients, subscriptions and
-- pending notifications in later files) carries the epoch that wrote it, and
-- whatever reads it compares that with the lease's current epoch.  So a new
-- claim makes all that an earlier epoch left invisible at once, in a time
-- that does not depend on how much there is, and broker_sweep()
-- (550_sweep.sql) removes it afterwards in bounded batches.

-- Advisory locks are keyed (class, key) with two int4 values, which PostgreSQL
-- never confuses with single-bigint advisory locks.  The class is 'pgbr'.
CREATE FUNCTION pgbroker._lock_class()
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823602 $$;
COMMENT ON FUNCTION pgbroker._lock_class() IS
    'Internal: the first key (0x70676272, ''pgbr'') of every pgbroker advisory lock; the second is lease.lock_key.';

-- A second session-level lock, 'pgbh' ("held"), follows the lease lock: the
-- holder of a session lease takes it when its claim commits and drops it when
-- its release commits (or its session ends).  It is keyed by the epoch, not
-- the lease: writers' triggers test it, for the epoch of the subscribers they
-- found, with a try-lock that they drop at once, and write nothing for an
-- epoch whose holder is gone or was replaced (600_triggers.sql).  A claim
-- never try-locks it, so that test can never make a claim fail; at worst the
-- holder waits the microseconds a test lasts.
CREATE FUNCTION pgbroker._lock_class_alive()
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823592 $$;
COMMENT ON FUNCTION pgbroker._lock_class_alive() IS
    'Internal: ''pgbh''; (class, _epoch_key(epoch)) is held (session level) by the holder of a session lease''s epoch while it holds it.';

-- The second key of an epoch's "held" lock: its low 31 bits.  Two epochs
-- share a key only 2^31 claims apart (epochs come from one sequence), and an
-- earlier epoch's rows are swept long before that.
CREATE FUNCTION pgbroker._epoch_key(p_epoch bigint)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT (p_epoch & 2147483647)::integer $$;
COMMENT ON FUNCTION pgbroker._epoch_key(bigint) IS
    'Internal: the second key of the ''pgbh'' lock of epoch p_epoch (its low 31 bits).';

-- A session's identity: its pid and, since pids are reused, when it first
-- called pgbroker ('<pid>@<microseconds since 1970>', kept in the session's
-- setting pgbroker.session).  Not its backend_start: the functions run as
-- their owner, and pg_stat_activity hides other roles' backend_start (the
-- caller's own session included) from an owner without pg_read_all_stats.
-- A setting is private to its session, and a later session with the same pid
-- first calls pgbroker after this one ended, so no two sessions share an
-- identity.  DISCARD ALL (or RESET ALL) forgets it, as DISCARD ALL forgets
-- the session's advisory locks: the session is then a new one to pgbroker.
-- One SQL expression, inlined into its callers' queries (a PL/pgSQL call per
-- fetch cost the broker more than the rest of the fetch).
CREATE FUNCTION pgbroker._my_backend_start_lookup()
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_start timestamptz := date_trunc('microseconds', clock_timestamp());
BEGIN
    PERFORM set_config('pgbroker.session',
                       pg_backend_pid()::text || '@' || (extract(epoch FROM v_start) * 1000000)::bigint::text, false);
    RETURN v_start;
END
$$;
COMMENT ON FUNCTION pgbroker._my_backend_start_lookup() IS
    'Internal: give this session its identity, the time of its first pgbroker call, kept in the setting pgbroker.session.';

CREATE FUNCTION pgbroker._my_backend_start()
RETURNS timestamptz
LANGUAGE sql VOLATILE
AS $$
    SELECT CASE WHEN pg_catalog.split_part(pg_catalog.current_setting('pgbroker.session', true), '@', 1)
                     = pg_catalog.pg_backend_pid()::text
                THEN 'epoch'::timestamptz
                     + pg_catalog.split_part(pg_catalog.current_setting('pgbroker.session', true), '@', 2)::bigint
                       * interval '1 microsecond'
                ELSE pgbroker._my_backend_start_lookup() END
$$;
COMMENT ON FUNCTION pgbroker._my_backend_start() IS
    'Internal: this session''s identity with its pid: when it first called pgbroker (setting pgbroker.session); tells sessions apart even after pid reuse.';

CREATE TABLE pgbroker.lease (
    name text PRIMARY KEY,
    lock_key integer GENERATED ALWAYS AS IDENTITY
        CONSTRAINT lease_lock_key_unique UNIQUE,
    epoch bigint NOT NULL DEFAULT 0,
    state text NOT NULL DEFAULT 'new'
        CONSTRAINT lease_state_valid CHECK (state IN ('new', 'held', 'released', 'expired')),
    holder_pid integer,
    holder_backend_start timestamptz,
    holder_user name,
    holder_application text,
    holder_address inet,
    holder_info text,
    claimed_at timestamptz,
    heartbeat_at timestamptz,
    released_at timestamptz,
    -- Who holds it: the owner token the claim passed (NULL for a bare claim).
    owner text,
    -- A TTL lease (claimed with ttl =>) is held until expires_at unless
    -- renewed, with no session lock; a session lease has both NULL.
    ttl interval,
    expires_at timestamptz,
    -- Book-keeping for the deferred session-lock trigger (see _lease_sync_session_lock).
    sync_xid xid8,
    session_locked boolean NOT NULL DEFAULT false,
    CONSTRAINT lease_name_valid CHECK (name <> '' AND octet_length(name) <= 63)
);
COMMENT ON TABLE pgbroker.lease IS
    'One row per broker lease name: its current epoch and holder. Internal: read the view pgbroker.brokers.';
COMMENT ON COLUMN pgbroker.lease.name IS 'Lease name (1 to 63 bytes).';
COMMENT ON COLUMN pgbroker.lease.lock_key IS 'Second key of the advisory lock (pgbroker._lock_class(), lock_key); unique per name, so names never collide.';
COMMENT ON COLUMN pgbroker.lease.epoch IS 'Fencing token: greater than every epoch handed out before, across crashes and failovers ((WAL timeline - 1) * 2^40 + a sequence value, so it may skip values); 0 before the first claim.';
COMMENT ON COLUMN pgbroker.lease.state IS 'new (never claimed), held (claimed and not released), released, or expired (a TTL lease whose time ran out unrenewed, once noticed: lease_expiry_check()).';
COMMENT ON COLUMN pgbroker.lease.holder_pid IS 'Backend pid of the session that made the last claim.';
COMMENT ON COLUMN pgbroker.lease.holder_backend_start IS 'With holder_pid, the identity of that session: when it first called pgbroker (guards against pid reuse; see _my_backend_start()).';
COMMENT ON COLUMN pgbroker.lease.holder_user IS 'session_user of the holder.';
COMMENT ON COLUMN pgbroker.lease.holder_application IS 'application_name of the holder at claim time.';
COMMENT ON COLUMN pgbroker.lease.holder_address IS 'Client address of the holder (NULL for a Unix-socket connection).';
COMMENT ON COLUMN pgbroker.lease.holder_info IS 'Free text given by the claimant (broker_claim info =>), for example its hostname.';
COMMENT ON COLUMN pgbroker.lease.claimed_at IS 'When the current epoch was claimed.';
COMMENT ON COLUMN pgbroker.lease.heartbeat_at IS 'Last broker_heartbeat() of the holder (claim time until the first one).';
COMMENT ON COLUMN pgbroker.lease.released_at IS 'When the holder called broker_release(), if it did.';
COMMENT ON COLUMN pgbroker.lease.owner IS 'Owner token given by the holder''s claim (owner =>); NULL for a bare claim. Never shown in views or errors.';
COMMENT ON COLUMN pgbroker.lease.ttl IS 'For a TTL lease: its time to live (renewals extend it by this much by default); NULL for a session lease.';
COMMENT ON COLUMN pgbroker.lease.expires_at IS 'For a TTL lease: when it lapses unless renewed; NULL for a session lease.';
COMMENT ON COLUMN pgbroker.lease.sync_xid IS 'Internal: transaction that last changed the holder; see _lease_sync_session_lock().';
COMMENT ON COLUMN pgbroker.lease.session_locked IS 'Internal: whether the session of that transaction held the session-level lock when it began.';

-- Epochs of all names come from one sequence: a number once handed out is
-- never handed out again, not even when the claim that got it rolled back.
-- A promoted standby may have missed any number of claims (asynchronous
-- replication), so its sequence can be behind the old primary's.  Every
-- promotion starts a new WAL timeline, so the epoch carries the timeline in
-- its high bits: epoch = (timeline - 1) * 2^40 + n, n from the sequence.
-- On timeline 1 the epochs are the sequence's values; after a failover every epoch
-- compares greater than any the old primary handed out, as one bigint.
CREATE SEQUENCE pgbroker.lease_epoch_seq AS bigint MAXVALUE 1099511627775;
COMMENT ON SEQUENCE pgbroker.lease_epoch_seq IS
    'Internal: the low 40 bits of lease epochs (fencing tokens), shared by all lease names, so a number is never reused even after a rolled-back claim.';

-- The epoch for a new claim: the current WAL timeline in the high bits, the
-- sequence in the low 40.
CREATE FUNCTION pgbroker._next_epoch()
RETURNS bigint
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT (('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint - 1) * 1099511627776
           + nextval('pgbroker.lease_epoch_seq')
$$;
COMMENT ON FUNCTION pgbroker._next_epoch() IS
    'Internal: a new epoch, (WAL timeline - 1) * 2^40 + the next value of lease_epoch_seq: greater than every epoch handed out before, across crashes and failovers.';

CREATE TABLE pgbroker.lease_event (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL,
    epoch bigint NOT NULL,
    event text NOT NULL
        CONSTRAINT lease_event_event_valid CHECK (event IN ('claim', 'takeover', 'stale_takeover', 'release', 'expired')),
    at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    pid integer NOT NULL,
    db_user name NOT NULL,
    application text,
    address inet,
    info text,
    previous_epoch bigint,
    previous_pid integer,
    previous_application text,
    previous_address inet,
    previous_heartbeat_at timestamptz,
    reason text NOT NULL
);
CREATE INDEX lease_event_name_epoch ON pgbroker.lease_event (name, epoch);
COMMENT ON TABLE pgbroker.lease_event IS
    'History of every claim, takeover, release and expiry, each announced on lease_channel() as it commits. Internal: read the view pgbroker.lease_history.';
COMMENT ON COLUMN pgbroker.lease_event.id IS 'Increasing event number.';
COMMENT ON COLUMN pgbroker.lease_event.name IS 'Lease name.';
COMMENT ON COLUMN pgbroker.lease_event.epoch IS 'Epoch claimed or released.';
COMMENT ON COLUMN pgbroker.lease_event.at IS 'When it happened (clock time inside the acting transaction).';
COMMENT ON COLUMN pgbroker.lease_event.pid IS 'Backend pid of the session that acted (for expired: of the holder whose lease lapsed).';
COMMENT ON COLUMN pgbroker.lease_event.db_user IS 'Database user (session_user) that acted.';
COMMENT ON COLUMN pgbroker.lease_event.application IS 'Its application_name.';
COMMENT ON COLUMN pgbroker.lease_event.address IS 'Its client address (NULL over a Unix socket).';
COMMENT ON COLUMN pgbroker.lease_event.info IS 'The info text given to broker_claim().';
COMMENT ON COLUMN pgbroker.lease_event.previous_epoch IS 'For a claim: the epoch it replaced.';
COMMENT ON COLUMN pgbroker.lease_event.previous_pid IS 'For a claim: the previous holder''s pid.';
COMMENT ON COLUMN pgbroker.lease_event.previous_application IS 'For a claim: the previous holder''s application_name.';
COMMENT ON COLUMN pgbroker.lease_event.previous_address IS 'For a claim: the previous holder''s address.';
COMMENT ON COLUMN pgbroker.lease_event.previous_heartbeat_at IS 'For a claim: the previous holder''s last heartbeat.';
COMMENT ON COLUMN pgbroker.lease_event.event IS 'claim, takeover (holder terminated by takeover => true), stale_takeover (holder terminated because its heartbeat was older than stale_after), release, or expired (a TTL lease that lapsed unrenewed).';
COMMENT ON COLUMN pgbroker.lease_event.reason IS 'Why: who took over from whom, how old the heartbeat was, whether the previous holder had released or died.';

-- ---------------------------------------------------------------------------
-- Lease events: every history row is announced on lease_channel() by the
-- transaction that writes it, so a NOTIFY arrives exactly when the change it
-- names commits (and never for a claim that rolled back).  Observers LISTEN
-- before they read pgbroker.brokers and miss nothing.

CREATE FUNCTION pgbroker.lease_channel()
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 'pgbroker_lease'::text $$;
COMMENT ON FUNCTION pgbroker.lease_channel() IS
$$The channel every lease event is announced on as it commits: pgbroker_lease. Payload: a JSON object with name, epoch,
event (claim, release, takeover, stale_takeover, expired), pid (the new holder's; for release and expired, the one that
left), application, info (its first 1,000 bytes), at, previous_epoch and previous_pid (for a claim).$$;

CREATE FUNCTION pgbroker._lease_event_announce()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pg_notify('pgbroker_lease',
                      json_build_object('name', NEW.name, 'epoch', NEW.epoch, 'event', NEW.event, 'pid', NEW.pid,
                                        'application', NEW.application,
                                        'info', left(NEW.info, 1000),   -- a NOTIFY payload holds 8,000 bytes
                                        'at', NEW.at, 'previous_epoch', NEW.previous_epoch,
                                        'previous_pid', NEW.previous_pid)::text);
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_event_announce() IS
    'Internal (trigger): announce a new lease history row on lease_channel() (delivered when its transaction commits).';

CREATE TRIGGER _100_announce
AFTER INSERT ON pgbroker.lease_event
FOR EACH ROW EXECUTE FUNCTION pgbroker._lease_event_announce();
COMMENT ON TRIGGER _100_announce ON pgbroker.lease_event IS 'Every lease event is announced on lease_channel() at its commit.';

-- ---------------------------------------------------------------------------
-- Broker state: a small key/value store per lease, written only by the
-- holder, wiped by every new claim.
-- Keyed by epoch too, so that a new epoch's writes never meet (nor wait for)
-- the rows an earlier one left, which broker_sweep() deletes.
CREATE TABLE pgbroker.state (
    name text NOT NULL REFERENCES pgbroker.lease (name) ON DELETE CASCADE,
    epoch bigint NOT NULL,
    key text NOT NULL,
    value jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    PRIMARY KEY (name, epoch, key)
);
COMMENT ON TABLE pgbroker.state IS
    'Key/value state of the current broker of each lease; what earlier epochs wrote is invisible and swept by broker_sweep(). Internal: use broker_state_set() and the view pgbroker.broker_state.';
COMMENT ON COLUMN pgbroker.state.name IS 'Lease name.';
COMMENT ON COLUMN pgbroker.state.key IS 'Key.';
COMMENT ON COLUMN pgbroker.state.epoch IS 'Epoch of the broker that wrote it; rows of earlier epochs are invisible and swept by broker_sweep().';
COMMENT ON COLUMN pgbroker.state.value IS 'Value.';
COMMENT ON COLUMN pgbroker.state.updated_at IS 'When it was last set.';

-- ---------------------------------------------------------------------------
-- Errors.  Every error a user can hit is raised here or by PostgreSQL with a
-- documented SQLSTATE (sql/README.md, "SQLSTATEs").

CREATE FUNCTION pgbroker._check_name(p_name text)
RETURNS text
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_name IS NULL THEN
        RAISE EXCEPTION 'lease name must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF p_name = '' THEN
        RAISE EXCEPTION 'lease name must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF octet_length(p_name) > 63 THEN
        RAISE EXCEPTION 'lease name is too long: % bytes, at most 63 allowed', octet_length(p_name)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN p_name;
END
$$;
COMMENT ON FUNCTION pgbroker._check_name(text) IS
    'Internal: validate a lease name (22004 when NULL, 22023 when empty or over 63 bytes).';

-- Is the holder of epoch p_epoch, session (pid, identity), alive and holding
-- the lease's lock?  Asked of this very session, its identity says; of
-- another, pg_locks, which every role sees whole: the session holds the
-- lease's lock and the epoch's "held" lock, which it takes when its claim
-- commits.  A later session that got the dead holder's pid holds that epoch's
-- "held" lock never, so pid reuse does not fool it.
CREATE FUNCTION pgbroker._lease_alive(p_pid integer, p_backend_start timestamptz, p_lock_key integer, p_epoch bigint)
RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- PL/pgSQL, not SQL: its statements' plans are kept for the session (a
    -- SQL function with SET is planned anew at every call).
    IF p_pid IS NULL THEN
        RETURN false;
    END IF;
    IF p_pid = pg_backend_pid() THEN
        RETURN coalesce(p_backend_start = pgbroker._my_backend_start(), false)
               AND EXISTS (SELECT FROM pg_locks l
                            WHERE l.locktype = 'advisory'
                              AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
                              AND l.classid = pgbroker._lock_class()::oid
                              AND l.objid = p_lock_key::oid
                              AND l.objsubid = 2
                              AND l.granted
                              AND l.pid = p_pid);
    END IF;
    RETURN (SELECT count(DISTINCT l.classid) = 2 FROM pg_locks l
             WHERE l.locktype = 'advisory'
               AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
               AND ((l.classid = pgbroker._lock_class()::oid AND l.objid = p_lock_key::oid)
                    OR (l.classid = pgbroker._lock_class_alive()::oid AND l.objid = pgbroker._epoch_key(p_epoch)::oid))
               AND l.objsubid = 2
               AND l.granted
               AND l.pid = p_pid);
END
$$;
COMMENT ON FUNCTION pgbroker._lease_alive(integer, timestamptz, integer, bigint) IS
    'Internal: true when session p_pid (identity p_backend_start) holds the advisory lock p_lock_key (and, another session, the held lock of epoch p_epoch).';

-- Is the lease held by someone alive: a TTL lease until it expires, a
-- session lease while its holder's session holds the lock.
CREATE FUNCTION pgbroker._lease_live(p_lease pgbroker.lease)
RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT p_lease.state = 'held'
       AND CASE WHEN p_lease.expires_at IS NOT NULL THEN p_lease.expires_at > pg_catalog.clock_timestamp()
                ELSE pgbroker._lease_alive(p_lease.holder_pid, p_lease.holder_backend_start, p_lease.lock_key, p_lease.epoch) END
$$;
COMMENT ON FUNCTION pgbroker._lease_live(pgbroker.lease) IS
    'Internal: true when the lease is held and alive: a TTL lease not yet expired, or a session lease whose holder''s session holds the lock.';

-- The backend that holds the advisory lock of a lease right now, if any.
CREATE FUNCTION pgbroker._lock_holder_pid(p_lock_key integer)
RETURNS integer
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT l.pid FROM pg_catalog.pg_locks l
     WHERE l.locktype = 'advisory'
       AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
       AND l.classid = pgbroker._lock_class()::oid
       AND l.objid = p_lock_key::oid
       AND l.objsubid = 2
       AND l.granted
     LIMIT 1
$$;
COMMENT ON FUNCTION pgbroker._lock_holder_pid(integer) IS
    'Internal: pid of the backend holding the advisory lock p_lock_key, or NULL.';

CREATE FUNCTION pgbroker._raise_held(p_name text)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lease pgbroker.lease;
    v_pid integer;
BEGIN
    SELECT * INTO v_lease FROM pgbroker.lease WHERE name = p_name;
    IF v_lease.expires_at IS NOT NULL AND pgbroker._lease_live(v_lease) THEN
        RAISE EXCEPTION 'lease "%" is held until % (a TTL lease claimed by pid %, application "%", epoch %)',
                p_name, v_lease.expires_at, v_lease.holder_pid, coalesce(v_lease.holder_application, ''), v_lease.epoch
            USING ERRCODE = 'lock_not_available',
                  DETAIL = jsonb_build_object('name', p_name, 'pid', v_lease.holder_pid,
                                              'application', v_lease.holder_application,
                                              'address', host(v_lease.holder_address), 'user', v_lease.holder_user,
                                              'info', v_lease.holder_info, 'epoch', v_lease.epoch,
                                              'since', v_lease.claimed_at, 'heartbeat_at', v_lease.heartbeat_at,
                                              'expires_at', v_lease.expires_at)::text,
                  HINT = 'Wait for it to expire or be released (wait => interval), or take it over (takeover => true, pgbroker_admin only).';
    END IF;
    v_pid := pgbroker._lock_holder_pid(v_lease.lock_key);
    IF v_pid IS NOT DISTINCT FROM v_lease.holder_pid AND v_lease.state = 'held' THEN
        RAISE EXCEPTION 'lease "%" is held by pid % (application "%", address %, epoch %, since %)',
                p_name, v_pid, coalesce(v_lease.holder_application, ''),
                coalesce(host(v_lease.holder_address), 'local'), v_lease.epoch, v_lease.claimed_at
            USING ERRCODE = 'lock_not_available',
                  DETAIL = jsonb_build_object('name', p_name, 'pid', v_pid, 'application', v_lease.holder_application,
                                              'address', host(v_lease.holder_address), 'user', v_lease.holder_user,
                                              'info', v_lease.holder_info, 'epoch', v_lease.epoch,
                                              'since', v_lease.claimed_at, 'heartbeat_at', v_lease.heartbeat_at)::text,
                  HINT = 'Wait for it (wait => interval, or NULL to wait until the holder''s session ends), '
                         'take over a hung holder (stale_after => interval), or terminate it (takeover => true, pgbroker_admin only).';
    ELSE
        -- The lock is held by a session that is not the recorded holder: a claim
        -- of that session is committing right now, or a stray lock (sql/README.md, "Internals").
        RAISE EXCEPTION 'lease "%" is locked by pid %, which is not its recorded holder (a claim committing now, or a stray lock)',
                p_name, v_pid
            USING ERRCODE = 'lock_not_available',
                  DETAIL = jsonb_build_object('name', p_name, 'pid', v_pid, 'recorded_pid', v_lease.holder_pid,
                                              'state', v_lease.state, 'epoch', v_lease.epoch)::text,
                  HINT = 'Retry, or end that session (takeover => true).';
    END IF;
END
$$;
COMMENT ON FUNCTION pgbroker._raise_held(text) IS
    'Internal: raise 55P03 lock_not_available naming the session that holds lease p_name (DETAIL: a JSON object).';

-- Convert a wait interval into a lock_timeout value in milliseconds ('0' = forever).
CREATE FUNCTION pgbroker._wait_ms(p_wait interval)
RETURNS text
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_ms numeric;
BEGIN
    IF p_wait IS NULL THEN
        RETURN '0';
    END IF;
    v_ms := ceil(extract(epoch FROM p_wait) * 1000);
    IF v_ms < 0 THEN
        RAISE EXCEPTION 'wait must not be negative: %', p_wait
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Use ''0'' to fail at once, NULL to wait forever.';
    END IF;
    IF v_ms > 2147483647 THEN
        RAISE EXCEPTION 'wait is too long: % (at most 24 days; NULL waits forever)', p_wait
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN greatest(v_ms, 1)::bigint::text;
END
$$;
COMMENT ON FUNCTION pgbroker._wait_ms(interval) IS
    'Internal: a wait interval as a lock_timeout in ms (NULL gives 0, i.e. no limit); 22023 when negative or over 24 days.';

-- ---------------------------------------------------------------------------
-- Timed waits on advisory locks, right by construction.
--
-- A wait with lock_timeout can end with the lock granted AND the timeout
-- error raised: the releaser grants the lock to the first waiter in shared
-- memory while the waiter's timer fires; the waiter then processes the
-- pending cancel inside its wait, and its error cleanup (LockErrorCleanup)
-- finds the grant and records it.  A session-level lock outlives the
-- rollback of the EXCEPTION block, so a caller that answered "not acquired"
-- kept the lock (issue 41); a transaction-level one is given back by that
-- rollback, so for an instant the lock was held by a call that answers "not
-- acquired", and a try by anyone else in that instant failed although nobody
-- held it.  Both are not linearizable.  So every timed wait on an advisory
-- lock goes through _advisory_wait: it waits on a session-level lock,
-- asks pg_locks after a timeout whether the lock was granted all the same,
-- and counts such a grant as acquired (the lock was granted within the call,
-- and the call says so); a transaction-scope wait then holds the lock for
-- the transaction and drops the session hold (at once: both are its own).
-- Any other error during the wait (a cancel, statement_timeout, a deadlock)
-- gives a lock granted meanwhile back before it is raised again: an error
-- means not acquired.

-- Does this session hold advisory lock (p_class, p_key) in this mode (any scope)?
CREATE FUNCTION pgbroker._advisory_held(p_class integer, p_key integer, p_shared boolean)
RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (SELECT FROM pg_catalog.pg_locks l
                    WHERE l.locktype = 'advisory'
                      AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database())
                      AND l.classid = p_class::oid AND l.objid = p_key::oid AND l.objsubid = 2
                      AND l.pid = pg_catalog.pg_backend_pid() AND l.granted
                      AND l.mode = CASE WHEN p_shared THEN 'ShareLock' ELSE 'ExclusiveLock' END)
$$;
COMMENT ON FUNCTION pgbroker._advisory_held(integer, integer, boolean) IS
    'Internal: whether this session holds advisory lock (p_class, p_key) in the mode p_shared names (pg_locks: session or transaction scope).';

-- A session hold of advisory lock (p_class, p_key) made a transaction hold:
-- taken at once (the session holds it), then the session hold goes.
CREATE FUNCTION pgbroker._advisory_to_xact(p_class integer, p_key integer, p_shared boolean)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_shared THEN
        PERFORM pg_advisory_xact_lock_shared(p_class, p_key);
        PERFORM pg_advisory_unlock_shared(p_class, p_key);
    ELSE
        PERFORM pg_advisory_xact_lock(p_class, p_key);
        PERFORM pg_advisory_unlock(p_class, p_key);
    END IF;
END
$$;
COMMENT ON FUNCTION pgbroker._advisory_to_xact(integer, integer, boolean) IS
    'Internal: turn this session''s hold of advisory lock (p_class, p_key) into a hold for the transaction.';

-- Wait at most p_wait (NULL: without limit) for advisory lock (p_class,
-- p_key) in the mode p_shared names, held for the session, or for the
-- transaction with p_xact.  The caller has just tried it and failed, so this
-- session does not hold it in that mode (a session's own holds never
-- conflict with its requests): a grant that pg_locks shows after the wait
-- was made to this call.
CREATE FUNCTION pgbroker._advisory_wait(p_class integer, p_key integer, p_shared boolean, p_xact boolean, p_wait interval)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_timeout text := current_setting('lock_timeout');
    v_got boolean;
BEGIN
    BEGIN
        PERFORM set_config('lock_timeout', pgbroker._wait_ms(p_wait), true);
        IF p_shared THEN
            PERFORM pg_advisory_lock_shared(p_class, p_key);
        ELSE
            PERFORM pg_advisory_lock(p_class, p_key);
        END IF;
        PERFORM set_config('lock_timeout', v_timeout, true);
        IF p_xact THEN
            PERFORM pgbroker._advisory_to_xact(p_class, p_key, p_shared);
        END IF;
        RETURN true;
    EXCEPTION
        WHEN lock_not_available THEN
            -- The wait ran out; granted all the same at that moment?  (The
            -- block's rollback has restored lock_timeout.)
            v_got := pgbroker._advisory_held(p_class, p_key, p_shared);
        WHEN query_canceled OR others THEN
            -- In the block, a transaction hold was undone with it; a session
            -- hold is not: give it back.
            IF pgbroker._advisory_held(p_class, p_key, p_shared) THEN
                IF p_shared THEN
                    PERFORM pg_advisory_unlock_shared(p_class, p_key);
                ELSE
                    PERFORM pg_advisory_unlock(p_class, p_key);
                END IF;
            END IF;
            RAISE;
    END;
    IF v_got AND p_xact THEN
        PERFORM pgbroker._advisory_to_xact(p_class, p_key, p_shared);
    END IF;
    RETURN v_got;
END
$$;
COMMENT ON FUNCTION pgbroker._advisory_wait(integer, integer, boolean, boolean, interval) IS
    'Internal: wait at most p_wait (NULL: no limit) for advisory lock (p_class, p_key), shared or exclusive, for the session or (p_xact) the transaction; true when acquired, also when granted just as the wait ran out; an error during the wait leaves no hold behind. Call it only after a failed try.';

-- ---------------------------------------------------------------------------
-- Turning the claim's transaction lock into a session lock, at commit.

-- Record, the first time a transaction changes a lease's holder, whether this
-- session held the session-level lock when the transaction began.
CREATE FUNCTION pgbroker._lease_touch(p_lease pgbroker.lease)
RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN p_lease.sync_xid IS NOT DISTINCT FROM pg_catalog.pg_current_xact_id_if_assigned()
                THEN p_lease.session_locked
                ELSE p_lease.state = 'held'
                     AND p_lease.expires_at IS NULL
                     AND p_lease.holder_pid = pg_catalog.pg_backend_pid()
                     AND p_lease.holder_backend_start = pgbroker._my_backend_start()
           END
$$;
COMMENT ON FUNCTION pgbroker._lease_touch(pgbroker.lease) IS
    'Internal: whether this session holds the session-level lock of the lease as of the start of the current transaction.';

CREATE FUNCTION pgbroker._lease_sync_session_lock()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lease pgbroker.lease;
    v_want boolean;
BEGIN
    SELECT * INTO v_lease FROM pgbroker.lease WHERE name = NEW.name;
    IF NOT FOUND OR v_lease.sync_xid IS DISTINCT FROM pg_current_xact_id() THEN
        RETURN NULL;
    END IF;
    v_want := v_lease.state = 'held'
              AND v_lease.expires_at IS NULL   -- a TTL lease has no session lock
              AND v_lease.holder_pid = pg_backend_pid()
              AND v_lease.holder_backend_start = pgbroker._my_backend_start();
    IF v_want = v_lease.session_locked THEN
        RETURN NULL;
    END IF;
    IF v_want THEN
        -- We hold the transaction-level lock, so this succeeds at once.
        PERFORM pg_advisory_lock(pgbroker._lock_class(), v_lease.lock_key);
        PERFORM pg_advisory_lock(pgbroker._lock_class_alive(), pgbroker._epoch_key(v_lease.epoch));
    ELSE
        -- (A session that held the lock held it for this epoch: a claim of
        -- the holder's own session never changes the epoch.)
        PERFORM pg_advisory_unlock(pgbroker._lock_class(), v_lease.lock_key);
        PERFORM pg_advisory_unlock(pgbroker._lock_class_alive(), pgbroker._epoch_key(v_lease.epoch));
    END IF;
    UPDATE pgbroker.lease SET session_locked = v_want WHERE name = NEW.name;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_sync_session_lock() IS
    'Internal deferred trigger: at commit, take (claim) or drop (release) the session-level advisory lock so that it follows the transaction.';

CREATE CONSTRAINT TRIGGER _900_sync_session_lock
    AFTER UPDATE OF epoch, state ON pgbroker.lease
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION pgbroker._lease_sync_session_lock();
COMMENT ON TRIGGER _900_sync_session_lock ON pgbroker.lease IS
    'Takes or drops the session-level advisory lock when the claiming or releasing transaction commits.';

-- Release session-level locks of this backend that no lease row accounts for.
-- They can only exist if a transaction failed after its commit-time trigger
-- ran (for example SET CONSTRAINTS ALL IMMEDIATE followed by ROLLBACK).
CREATE FUNCTION pgbroker._lease_sweep()
RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_class integer;
    v_key integer;
    v_count integer := 0;
BEGIN
    FOR v_class, v_key IN
        SELECT l.classid::integer, l.objid::integer
          FROM pg_catalog.pg_locks l
         WHERE l.locktype = 'advisory'
           AND l.pid = pg_backend_pid()
           AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
           AND l.classid IN (pgbroker._lock_class()::oid, pgbroker._lock_class_alive()::oid)
           AND l.objsubid = 2
           AND l.granted
           AND NOT EXISTS (
                   SELECT FROM pgbroker.lease r
                    WHERE CASE WHEN l.classid = pgbroker._lock_class()::oid THEN r.lock_key
                               ELSE pgbroker._epoch_key(r.epoch) END = l.objid::integer
                      AND (   -- claimed: committed (session lock) or in this transaction (xact lock)
                              (r.state = 'held' AND r.expires_at IS NULL AND r.holder_pid = pg_backend_pid()
                               AND r.holder_backend_start = pgbroker._my_backend_start())
                              -- released in this transaction: the session lock goes at commit
                           OR (r.sync_xid = pg_current_xact_id_if_assigned() AND r.session_locked)))
    LOOP
        PERFORM pg_advisory_unlock(v_class, v_key);
        v_count := v_count + (v_class = pgbroker._lock_class())::integer;  -- the alive lock goes with its lease lock
    END LOOP;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_sweep() IS
    'Internal: release session-level pgbroker locks of this backend that no lease row accounts for (stray locks).';

-- ---------------------------------------------------------------------------
-- TTL leases that lapse.  A TTL lease whose time ran out unrenewed is free
-- from that moment (_lease_live says so), but no statement runs then to say
-- it.  The first to notice records it, state 'expired' and a history event
-- 'expired' (announced like every event): the next claim of the name, a
-- sweep (broker_sweep), an observer (lease_expiry_check).

CREATE FUNCTION pgbroker._lease_expire(p_name text)
RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_count integer;
BEGIN
    WITH lapsed AS (
        UPDATE pgbroker.lease l SET state = 'expired'
         WHERE (p_name IS NULL OR l.name = p_name)
           AND l.state = 'held' AND l.expires_at <= clock_timestamp()
        RETURNING l.*
    )
    INSERT INTO pgbroker.lease_event (name, epoch, event, pid, db_user, application, address, info, reason)
    SELECT x.name, x.epoch, 'expired', x.holder_pid, x.holder_user, x.holder_application, x.holder_address, x.holder_info,
           format('the TTL lease of epoch %s expired at %s unrenewed (noticed by pid %s)', x.epoch, x.expires_at,
                  pg_backend_pid())
      FROM lapsed x;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_expire(text) IS
    'Internal: mark the TTL leases of p_name (NULL: all) whose time ran out expired, with an expired event each; returns how many.';

-- ---------------------------------------------------------------------------
-- Terminating a holder.

CREATE FUNCTION pgbroker._lease_terminate(p_name text, p_pid integer)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_role oid;
BEGIN
    -- The right first, as pg_terminate_backend() judges it for the functions'
    -- owner (current_user here), so that a claim that may not terminate fails
    -- before anything is done: a superuser's session only by a superuser;
    -- another only with pg_signal_backend or the rights of the session's role.
    -- (usesysid is shown to every role; backend_start and state are not.)
    SELECT a.usesysid INTO v_role FROM pg_stat_get_activity(p_pid) a;
    IF v_role IS NOT NULL AND NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user) THEN
        IF (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = v_role) THEN
            RAISE EXCEPTION 'cannot terminate pid % holding lease "%": it is a session of superuser %, and only a superuser may end one (pgbroker''s functions run as %, not a superuser)',
                    p_pid, p_name, v_role::regrole, current_user
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'End that session as a superuser (SELECT pg_terminate_backend(pid)), and let brokers log in as ordinary roles.';
        END IF;
        IF NOT pg_has_role(current_user, v_role, 'USAGE') AND NOT pg_has_role(current_user, 'pg_signal_backend', 'USAGE') THEN
            RAISE EXCEPTION 'cannot terminate pid % (role %) holding lease "%": pgbroker''s functions run as role %, which lacks pg_signal_backend',
                    p_pid, v_role::regrole, p_name, current_user
                USING ERRCODE = 'insufficient_privilege',
                      HINT = format('As a superuser (or a role with ADMIN OPTION on it): GRANT pg_signal_backend TO %I;', current_user);
        END IF;
    END IF;
    -- No timeout argument: that would poll for the exit every 100 ms.  The
    -- caller waits on the advisory lock instead, which it gets the moment the
    -- terminated backend releases it.
    BEGIN
        RETURN pg_terminate_backend(p_pid);
    EXCEPTION WHEN insufficient_privilege THEN
        RAISE EXCEPTION 'cannot terminate pid % holding lease "%": pgbroker''s functions run as role %, which lacks the right to',
                p_pid, p_name, current_user
            USING ERRCODE = 'insufficient_privilege',
                  HINT = format('As a superuser (or a role with ADMIN OPTION on it): GRANT pg_signal_backend TO %I;', current_user);
    END;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_terminate(text, integer) IS
    'Internal: send SIGTERM to backend p_pid (the claim then waits for its lock).';

-- Privileged takeover: terminate whoever holds the lock.  Only broker_claim()
-- calls it, after checking that the caller is a pgbroker_admin.
CREATE FUNCTION pgbroker._lease_takeover(p_name text)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_pid integer;
BEGIN
    v_pid := pgbroker._lock_holder_pid((SELECT lock_key FROM pgbroker.lease WHERE name = p_name));
    IF v_pid IS NOT NULL AND v_pid <> pg_backend_pid() THEN
        PERFORM pgbroker._lease_terminate(p_name, v_pid);
    END IF;
    RETURN v_pid;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_takeover(text) IS
    'Internal: terminate the backend holding lease p_name; returns its pid.';

-- Stale takeover: terminate the recorded holder only if it still holds the
-- lock and its last heartbeat is older than p_stale_after.
CREATE FUNCTION pgbroker._lease_takeover_stale(p_name text, p_stale_after interval)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lease pgbroker.lease;
BEGIN
    SELECT * INTO v_lease FROM pgbroker.lease WHERE name = p_name;
    IF v_lease.state = 'held'
       AND v_lease.heartbeat_at < clock_timestamp() - p_stale_after
       AND v_lease.holder_pid <> pg_backend_pid()
       AND pgbroker._lease_alive(v_lease.holder_pid, v_lease.holder_backend_start, v_lease.lock_key, v_lease.epoch) THEN
        PERFORM pgbroker._lease_terminate(p_name, v_lease.holder_pid);
        RETURN v_lease.holder_pid;
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_takeover_stale(text, interval) IS
    'Internal: terminate the holder of lease p_name if its heartbeat is older than p_stale_after; returns its pid or NULL.';

-- ---------------------------------------------------------------------------
-- The claim proper, once the caller's rights have been checked.
--
-- Waiting: the session blocks on the advisory lock for at most p_wait (NULL:
-- without limit).  With p_stale_after it blocks in slices that end when the
-- recorded holder's heartbeat would turn stale, and checks again, so a holder
-- that stops heartbeating while we wait is taken over too.
CREATE FUNCTION pgbroker._lease_claim(p_name text, p_wait interval, p_terminated integer, p_stale_after interval, p_info text,
                                      p_owner text, p_ttl interval, p_takeover boolean)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_me integer := pg_backend_pid();
    v_me_start timestamptz := pgbroker._my_backend_start();
    v_deadline timestamptz;
    v_lease pgbroker.lease;
    v_prev pgbroker.lease;
    v_got boolean := false;
    v_lost boolean := false;
    v_old_timeout text := current_setting('lock_timeout');
    v_slice interval;
    v_killed integer := p_terminated;
    v_event text := CASE WHEN p_terminated IS NULL THEN 'claim' ELSE 'takeover' END;
    v_reason text;
    v_locked_before boolean;
BEGIN
    v_deadline := clock_timestamp() + p_wait;  -- NULL: no limit

    PERFORM pgbroker._lease_sweep();
    SELECT * INTO v_lease FROM pgbroker.lease WHERE name = p_name;
    IF v_lease.state = 'held' AND v_lease.expires_at <= clock_timestamp() THEN
        -- A TTL lease that lapsed unnoticed: say so before claiming over it.
        PERFORM pgbroker._lease_expire(p_name);
        SELECT * INTO v_lease FROM pgbroker.lease WHERE name = p_name;
    END IF;
    IF NOT FOUND THEN
        -- First claim of this name.  Only then INSERT: an INSERT ... ON
        -- CONFLICT waits for any open transaction that changed the row, which
        -- would make wait => '0' block.  It still waits for a concurrent
        -- first claim of the same name; that wait is bounded by p_wait.  A
        -- grant just as the wait runs out is undone with the block, INSERT
        -- and all, and the claim fails: right, as the other claim, which
        -- holds the lease's lock, was open throughout.
        BEGIN
            PERFORM set_config('lock_timeout',
                               pgbroker._wait_ms(CASE WHEN v_deadline IS NOT NULL
                                                      THEN greatest(v_deadline - clock_timestamp(), '0'::interval) END),
                               true);
            INSERT INTO pgbroker.lease (name) VALUES (p_name) ON CONFLICT (name) DO NOTHING;
            PERFORM set_config('lock_timeout', v_old_timeout, true);
        EXCEPTION WHEN lock_not_available THEN
            RAISE EXCEPTION 'lease "%" is being claimed for the first time by a transaction that has not committed yet', p_name
                USING ERRCODE = 'lock_not_available',
                      HINT = 'Wait for it (wait => interval, or NULL to wait until the holder''s session ends).';
        END;
        SELECT * INTO v_lease FROM pgbroker.lease WHERE name = p_name;
    END IF;

    -- Already held by this server session (committed, or claimed earlier in
    -- this transaction) ...
    IF v_lease.state = 'held' AND v_lease.expires_at IS NULL
       AND v_lease.holder_pid = v_me AND v_lease.holder_backend_start = v_me_start THEN
        IF pgbroker._lease_alive(v_me, v_me_start, v_lease.lock_key, v_lease.epoch) THEN
            -- Behind a pooler in transaction mode this server session carries
            -- many callers: only the claim's owner token proves that this is
            -- the same one.  A bare re-claim cannot prove it and is refused.
            IF p_owner IS NULL OR v_lease.owner IS DISTINCT FROM p_owner OR p_ttl IS NOT NULL THEN
                RAISE EXCEPTION 'lease "%" is already held by this server session (epoch %, %)', p_name, v_lease.epoch,
                        CASE WHEN v_lease.owner IS NULL THEN 'claimed without an owner token'
                             WHEN p_ttl IS NOT NULL AND v_lease.owner = p_owner THEN 'as a session lease, not a TTL one'
                             ELSE 'for another owner' END
                    USING ERRCODE = 'PB003',
                          DETAIL = jsonb_build_object('name', p_name, 'pid', v_me, 'application', v_lease.holder_application,
                                                      'epoch', v_lease.epoch, 'since', v_lease.claimed_at)::text,
                          HINT = 'Re-claim with the owner token of the claim (owner =>). Through a pooler in transaction mode, '
                                 'where callers share server sessions, use a TTL lease (ttl =>, owner =>).';
            END IF;
            RETURN v_lease.epoch;
        END IF;
        -- ... unless our lock is gone (pg_advisory_unlock_all(), DISCARD ALL):
        -- then another session may have had it meanwhile; claim a new epoch.
        v_lost := true;
    END IF;
    -- A live TTL lease of this owner, claimed again with a TTL: renew it.
    IF p_ttl IS NOT NULL AND v_lease.expires_at IS NOT NULL AND v_lease.owner = p_owner AND pgbroker._lease_live(v_lease) THEN
        UPDATE pgbroker.lease SET expires_at = clock_timestamp() + p_ttl, ttl = p_ttl, heartbeat_at = clock_timestamp()
         WHERE name = p_name;
        RETURN v_lease.epoch;
    END IF;

    v_got := pg_try_advisory_xact_lock(pgbroker._lock_class(), v_lease.lock_key);
    WHILE NOT v_got LOOP
        IF v_killed IS NULL AND p_stale_after IS NOT NULL THEN
            v_killed := pgbroker._lease_takeover_stale(p_name, p_stale_after);
            IF v_killed IS NOT NULL THEN
                v_event := 'stale_takeover';
            END IF;
        END IF;
        IF v_killed IS NOT NULL THEN
            -- The holder was terminated and its lock is about to go: wait for
            -- it (at least 5 s) even if the caller asked not to wait.
            v_slice := CASE WHEN v_deadline IS NOT NULL THEN greatest(v_deadline - clock_timestamp(), '5 s'::interval) END;
        ELSE
            EXIT WHEN clock_timestamp() >= v_deadline;
            v_slice := v_deadline - clock_timestamp();
            IF p_stale_after IS NOT NULL THEN
                -- Look again when the holder's heartbeat would turn stale
                -- (LEAST ignores NULL: no deadline, or no heartbeat).
                v_slice := least(v_slice,
                                 greatest((SELECT heartbeat_at + p_stale_after - clock_timestamp()
                                             FROM pgbroker.lease WHERE name = p_name), '0'::interval)
                                 + '50 ms'::interval);
            END IF;
        END IF;
        -- Waits on a session lock and then holds the lock for the transaction
        -- (a grant just as the slice ran out counts: see _advisory_wait).
        v_got := pgbroker._advisory_wait(pgbroker._lock_class(), v_lease.lock_key, false, true, v_slice);
        -- Not got: someone else got the lock of the holder we terminated.
        EXIT WHEN NOT v_got AND v_killed IS NOT NULL;
    END LOOP;

    IF NOT v_got THEN
        PERFORM pgbroker._raise_held(p_name);
    END IF;

    -- No session holds it; a live TTL lease may: wait until it expires or is
    -- released (looking every 100 ms), up to the deadline.  takeover => true
    -- claims over it.
    LOOP
        SELECT * INTO v_lease FROM pgbroker.lease WHERE name = p_name;
        EXIT WHEN v_lease.expires_at IS NULL OR NOT pgbroker._lease_live(v_lease);
        IF p_takeover THEN
            v_event := 'takeover';
            EXIT;
        END IF;
        IF clock_timestamp() >= v_deadline THEN
            PERFORM pgbroker._raise_held(p_name);
        END IF;
        PERFORM pg_sleep(greatest(extract(epoch FROM least(v_lease.expires_at, v_deadline, clock_timestamp() + '100 ms'::interval)
                                                    - clock_timestamp()), 0) + 0.001);
    END LOOP;

    -- FOR UPDATE conflicts with broker_assert()'s FOR KEY SHARE: a fenced
    -- transaction that asserted the old epoch commits before the new one exists.
    SELECT * INTO v_prev FROM pgbroker.lease WHERE name = p_name FOR UPDATE;
    -- Whether this session holds the session-level lock (not when it was lost).
    v_locked_before := NOT v_lost AND pgbroker._lease_touch(v_prev);

    v_reason := CASE
        WHEN v_event = 'takeover' AND v_prev.expires_at IS NOT NULL
            THEN format('takeover by %s of the TTL lease of epoch %s', session_user, v_prev.epoch)
        WHEN v_event = 'takeover' THEN format('takeover by %s: terminated pid %s (epoch %s)', session_user, v_killed, v_prev.epoch)
        WHEN v_event = 'stale_takeover' THEN format('heartbeat of pid %s (epoch %s) was %s old, stale_after %s: terminated',
                                                  v_killed, v_prev.epoch, clock_timestamp() - v_prev.heartbeat_at, p_stale_after)
        WHEN v_prev.state = 'new' THEN 'first claim'
        WHEN v_prev.state = 'released' THEN format('epoch %s was released', v_prev.epoch)
        WHEN v_prev.state = 'expired' THEN format('the TTL lease of epoch %s expired at %s', v_prev.epoch, v_prev.expires_at)
        WHEN v_prev.expires_at IS NOT NULL THEN format('the TTL lease of epoch %s expired at %s', v_prev.epoch, v_prev.expires_at)
        WHEN v_lost THEN format('the same session (pid %s) had lost the lock of epoch %s (pg_advisory_unlock_all() or DISCARD ALL)',
                                v_me, v_prev.epoch)
        WHEN v_prev.holder_pid = v_me AND v_prev.state = 'held'
            THEN format('pid %s (epoch %s) had lost its lock and its identity (DISCARD ALL), or ended', v_me, v_prev.epoch)
        ELSE format('session of pid %s (epoch %s) ended', v_prev.holder_pid, v_prev.epoch)
    END;

    -- The epoch comes from a sequence: a claim that rolls back after it
    -- returned its epoch has still used that number up.  Claims of one name
    -- are serialised by the lock and the row lock above, so it grows per name.
    -- The claim commits durably whatever the session's synchronous_commit:
    -- a broker must not act on an epoch that a crash could hand out again.
    PERFORM set_config('synchronous_commit', 'on', true);
    UPDATE pgbroker.lease
       SET epoch = pgbroker._next_epoch(),
           state = 'held',
           holder_pid = v_me,
           holder_backend_start = v_me_start,
           holder_user = session_user,
           holder_application = current_setting('application_name'),
           holder_address = inet_client_addr(),
           holder_info = p_info,
           claimed_at = clock_timestamp(),
           heartbeat_at = clock_timestamp(),
           released_at = NULL,
           owner = p_owner,
           ttl = p_ttl,
           expires_at = clock_timestamp() + p_ttl,
           sync_xid = pg_current_xact_id(),
           session_locked = v_locked_before
     WHERE name = p_name
    RETURNING * INTO v_lease;

    INSERT INTO pgbroker.lease_event
           (name, epoch, event, pid, db_user, application, address, info,
            previous_epoch, previous_pid, previous_application, previous_address, previous_heartbeat_at, reason)
    VALUES (p_name, v_lease.epoch, v_event, v_me, session_user, v_lease.holder_application, v_lease.holder_address, p_info,
            nullif(v_prev.epoch, 0), v_prev.holder_pid, v_prev.holder_application, v_prev.holder_address,
            v_prev.heartbeat_at, v_reason);

    RETURN v_lease.epoch;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_claim(text, interval, integer, interval, text, text, interval, boolean) IS
    'Internal: body of broker_claim() after argument checks and any privileged takeover (p_terminated: pid it terminated).';

-- ---------------------------------------------------------------------------
-- Public API.

CREATE FUNCTION pgbroker.broker_claim(
    name text DEFAULT 'default',
    wait interval DEFAULT '0',
    takeover boolean DEFAULT false,
    stale_after interval DEFAULT NULL,
    info text DEFAULT NULL,
    owner text DEFAULT NULL,
    ttl interval DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(broker_claim.name);
    v_terminated integer;
BEGIN
    PERFORM pgbroker._name_check('lease', v_name, true);
    PERFORM pgbroker._wait_ms(broker_claim.wait);
    IF pg_is_in_recovery() THEN
        RAISE EXCEPTION 'cannot claim lease "%" on a standby: this server is in recovery', v_name
            USING ERRCODE = 'read_only_sql_transaction',
                  HINT = 'Claim on the primary (with libpq, target_session_attrs=read-write finds it).';
    END IF;
    IF broker_claim.takeover IS NULL THEN
        RAISE EXCEPTION 'takeover must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF broker_claim.stale_after IS NOT NULL AND broker_claim.stale_after <= '0'::interval THEN
        RAISE EXCEPTION 'stale_after must be positive: %', broker_claim.stale_after
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF broker_claim.owner IS NOT NULL AND (broker_claim.owner = '' OR octet_length(broker_claim.owner) > 200) THEN
        RAISE EXCEPTION 'owner must be 1 to 200 bytes, got %', octet_length(broker_claim.owner)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF broker_claim.ttl IS NOT NULL AND (broker_claim.owner IS NULL OR broker_claim.ttl <= '0'::interval) THEN
        RAISE EXCEPTION 'a TTL lease needs a positive ttl and an owner token, got ttl % and %', broker_claim.ttl,
                        CASE WHEN broker_claim.owner IS NULL THEN 'no owner' ELSE 'an owner' END
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass owner => a token that identifies this caller (for example a UUID), the same in renewals.';
    END IF;
    -- SECURITY DEFINER hides the caller's current_user; session_user is the
    -- login role, whose rights bound what the session can do (it can always
    -- RESET ROLE back to it).
    IF broker_claim.takeover AND NOT pg_has_role(session_user, 'pgbroker_admin', 'MEMBER') THEN
        RAISE EXCEPTION 'permission denied to take over lease "%": role % is not a member of pgbroker_admin', v_name, session_user
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'Use stale_after => interval to take over a holder whose heartbeat stopped, or ask an administrator.';
    END IF;
    IF broker_claim.takeover THEN
        v_terminated := pgbroker._lease_takeover(v_name);
    END IF;
    RETURN pgbroker._lease_claim(v_name, broker_claim.wait, v_terminated, broker_claim.stale_after, broker_claim.info,
                                 broker_claim.owner, broker_claim.ttl, broker_claim.takeover);
END
$$;
COMMENT ON FUNCTION pgbroker.broker_claim(text, interval, boolean, interval, text, text, interval) IS
$$Claim the broker lease NAME for this session (with ttl: for the OWNER token, from any session) and return its new epoch (the fencing token).
wait: '0' fails at once with 55P03 if another session holds it; an interval blocks up to that long; NULL blocks until the holder's session ends.
takeover => true (the login role must be a member of pgbroker_admin, else 42501): terminate the holder, then claim.
stale_after: terminate a holder whose last broker_heartbeat() is older than this (checked again while waiting), then claim.
info: free text recorded with the holder (for example the hostname).
owner: a token identifying the caller (1 to 200 bytes, for example a UUID). A re-claim from the session that holds the lease returns its epoch only with the same owner; a bare re-claim, or one with another owner, fails with PB003 (through a pooler in transaction mode that is another caller).
ttl (with owner): a TTL lease, held with no session lock until ttl from now; renew it with broker_renew() (or a claim with the same owner and ttl), release it with broker_release(name, owner). It works through any pooler.
The broker state, clients, subscriptions and pending notifications of earlier epochs become invisible at once, whatever their number; broker_sweep() removes them.
The claim follows its transaction: it takes effect at commit and leaves no lock behind on error or rollback.$$;

CREATE FUNCTION pgbroker.broker_release(name text DEFAULT 'default', owner text DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(broker_release.name);
    v_lease pgbroker.lease;
    v_locked_before boolean;
BEGIN
    SELECT * INTO v_lease FROM pgbroker.lease WHERE lease.name = v_name FOR UPDATE;
    IF NOT FOUND OR v_lease.state <> 'held' THEN
        RETURN false;
    END IF;
    IF v_lease.expires_at IS NOT NULL THEN
        -- A TTL lease: its owner releases it, from any session.
        IF v_lease.owner IS DISTINCT FROM broker_release.owner THEN
            RETURN false;
        END IF;
    ELSIF v_lease.holder_pid <> pg_backend_pid() OR v_lease.holder_backend_start <> pgbroker._my_backend_start()
          OR (v_lease.owner IS NOT NULL AND v_lease.owner IS DISTINCT FROM broker_release.owner) THEN
        -- Not this session's, or (behind a pooler) another caller's.
        RETURN false;
    END IF;
    v_locked_before := pgbroker._lease_touch(v_lease);
    UPDATE pgbroker.lease
       SET state = 'released', released_at = clock_timestamp(),
           sync_xid = pg_current_xact_id(), session_locked = v_locked_before
     WHERE lease.name = v_name;
    INSERT INTO pgbroker.lease_event (name, epoch, event, pid, db_user, application, address, info, reason)
    VALUES (v_name, v_lease.epoch, 'release', pg_backend_pid(), session_user,
            current_setting('application_name'), inet_client_addr(), v_lease.holder_info, 'released by its holder');
    RETURN true;
END
$$;
COMMENT ON FUNCTION pgbroker.broker_release(text, text) IS
$$Release lease NAME (a clean hand-over): marks the lease released and, for a session lease, drops the lock when the transaction commits.
A session lease is released by its holder's session (with its owner token, if the claim gave one); a TTL lease by its owner token, from any session.
Returns false, changing nothing, otherwise.$$;

CREATE FUNCTION pgbroker.broker_renew(name text, owner text, ttl interval DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(broker_renew.name);
    v_expires timestamptz;
BEGIN
    PERFORM pgbroker._name_check('lease', v_name, true);
    IF broker_renew.ttl IS NOT NULL AND broker_renew.ttl <= '0'::interval THEN
        RAISE EXCEPTION 'ttl must be positive, got %', broker_renew.ttl USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE pgbroker.lease l
       SET expires_at = clock_timestamp() + coalesce(broker_renew.ttl, l.ttl),
           ttl = coalesce(broker_renew.ttl, l.ttl),
           heartbeat_at = clock_timestamp()
     WHERE l.name = v_name AND l.state = 'held' AND l.expires_at > clock_timestamp()
       AND l.owner = broker_renew.owner
    RETURNING l.expires_at INTO v_expires;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'lease "%" is not held by this owner: its TTL lease expired, was released or was never claimed by it', v_name
            USING ERRCODE = 'PB002', HINT = 'Claim it again (a new epoch): work fenced with the old epoch is refused.';
    END IF;
    RETURN v_expires;
END
$$;
COMMENT ON FUNCTION pgbroker.broker_renew(text, text, interval) IS
$$Extend the TTL lease NAME held by OWNER to TTL (default: the claim's ttl) from now, and return when it now expires.
PB002 when it is not held by OWNER any more (expired, released, or claimed by another): claim again.$$;

CREATE FUNCTION pgbroker.broker_heartbeat(name text DEFAULT 'default')
RETURNS timestamptz
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(broker_heartbeat.name);
    v_at timestamptz;
BEGIN
    PERFORM pgbroker._name_check('lease', v_name, true);
    UPDATE pgbroker.lease
       SET heartbeat_at = clock_timestamp()
     WHERE lease.name = v_name
       AND state = 'held'
       AND expires_at IS NULL   -- a session lease: a TTL lease is renewed with broker_renew()
       AND holder_pid = pg_backend_pid()
       AND holder_backend_start = pgbroker._my_backend_start()
    RETURNING heartbeat_at INTO v_at;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'this session does not hold lease "%"', v_name
            USING ERRCODE = 'PB001', HINT = 'Claim it first with broker_claim().';
    END IF;
    RETURN v_at;
END
$$;
COMMENT ON FUNCTION pgbroker.broker_heartbeat(text) IS
$$Called by the holder's session to show it is not hung; returns the recorded time.
A claim with stale_after => X may terminate a holder whose last heartbeat is older than X.
PB001 when this session does not hold the lease.$$;

CREATE FUNCTION pgbroker.broker_assert(name text, epoch bigint)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(broker_assert.name);
    v_lease pgbroker.lease;
BEGIN
    PERFORM pgbroker._name_check('lease', v_name, false);
    IF broker_assert.epoch IS NULL THEN
        RAISE EXCEPTION 'epoch must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- FOR KEY SHARE: heartbeats go on, but a concurrent claim (FOR UPDATE)
    -- waits for this transaction, or this waits for the claim and sees it.
    SELECT * INTO v_lease FROM pgbroker.lease WHERE lease.name = v_name FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'lease "%" has never been claimed', v_name USING ERRCODE = 'PB002';
    END IF;
    IF v_lease.epoch <> broker_assert.epoch THEN
        RAISE EXCEPTION 'epoch % of lease "%" is stale: the current epoch is %', broker_assert.epoch, v_name, v_lease.epoch
            USING ERRCODE = 'PB002', DETAIL = format('holder_pid=%s claimed_at=%s', v_lease.holder_pid, v_lease.claimed_at);
    END IF;
    IF v_lease.state = 'expired' THEN
        RAISE EXCEPTION 'epoch % of lease "%" expired at %', broker_assert.epoch, v_name, v_lease.expires_at
            USING ERRCODE = 'PB002';
    END IF;
    IF v_lease.state <> 'held' THEN
        RAISE EXCEPTION 'epoch % of lease "%" was released', broker_assert.epoch, v_name USING ERRCODE = 'PB002';
    END IF;
    -- A TTL lease must not have expired; a session lease's holder must be
    -- alive and still hold the lock (a lock lost to pg_advisory_unlock_all()
    -- or DISCARD ALL counts as gone: another session could claim any moment).
    IF NOT pgbroker._lease_live(v_lease) THEN
        IF v_lease.expires_at IS NOT NULL THEN
            RAISE EXCEPTION 'epoch % of lease "%" expired at %', broker_assert.epoch, v_name, v_lease.expires_at
                USING ERRCODE = 'PB002';
        END IF;
        RAISE EXCEPTION 'the holder of epoch % of lease "%" (pid %) is gone or no longer holds its lock',
                broker_assert.epoch, v_name, v_lease.holder_pid
            USING ERRCODE = 'PB002';
    END IF;
END
$$;
COMMENT ON FUNCTION pgbroker.broker_assert(text, bigint) IS
$$Fencing check for use inside any transaction: raises PB002 unless EPOCH is the current epoch of lease NAME and its holder's session is alive and holds the lock.
Holds a key-share lock on the lease row until the transaction ends, so a concurrent claim cannot commit a newer epoch before this transaction does.$$;

CREATE FUNCTION pgbroker.broker_alive(name text DEFAULT 'default')
RETURNS boolean
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pgbroker._name_check('lease', broker_alive.name, false);
    SELECT coalesce((SELECT pgbroker._lease_live(l) FROM pgbroker.lease l WHERE l.name = broker_alive.name), false);
$$;
CREATE FUNCTION pgbroker.lease_expiry_check(name text DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF lease_expiry_check.name IS NOT NULL THEN
        PERFORM pgbroker._name_check('lease', pgbroker._check_name(lease_expiry_check.name), false);
    END IF;
    RETURN pgbroker._lease_expire(lease_expiry_check.name);
END
$$;
COMMENT ON FUNCTION pgbroker.lease_expiry_check(text) IS
$$Record, and announce on lease_channel() (event expired), every TTL lease of NAME (NULL: of every name) whose time ran out unrenewed; returns how many.
The next claim of a name and broker_sweep() do it too; an observer that sees a TTL holder's expires_at pass calls it, so that every observer hears of the expiry.$$;

COMMENT ON FUNCTION pgbroker.broker_alive(text) IS
$$True when lease NAME is held and alive: a TTL lease not yet expired, a session lease whose holder's session exists and holds the lock; false otherwise (also for an unknown name).
pgbroker_reader and pgbroker_broker may ask; it reads pg_locks, which shows every role's sessions.$$;

-- ---------------------------------------------------------------------------
-- Broker state API.

CREATE FUNCTION pgbroker._holder_epoch(p_name text)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    v_epoch bigint;
BEGIN
    PERFORM pgbroker._name_check('lease', pgbroker._check_name(p_name), true);
    SELECT epoch INTO v_epoch FROM pgbroker.lease
     WHERE name = p_name
       AND state = 'held'
       AND expires_at IS NULL   -- a session lease; a TTL holder passes its epoch instead
       AND holder_pid = pg_backend_pid()
       AND holder_backend_start = pgbroker._my_backend_start();
    IF NOT FOUND THEN
        RAISE EXCEPTION 'this session does not hold lease "%"', p_name
            USING ERRCODE = 'PB001', HINT = 'Only the holder''s session may change broker state.';
    END IF;
    RETURN v_epoch;
END
$$;
COMMENT ON FUNCTION pgbroker._holder_epoch(text) IS
    'Internal: the epoch of lease p_name if this session holds it as a session lease, else PB001.';

CREATE FUNCTION pgbroker.broker_state_set(name text, key text, value jsonb)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_epoch bigint := pgbroker._holder_epoch(broker_state_set.name);
BEGIN
    IF broker_state_set.key IS NULL OR broker_state_set.value IS NULL THEN
        RAISE EXCEPTION 'key and value must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    INSERT INTO pgbroker.state AS s (name, epoch, key, value)
    VALUES (broker_state_set.name, v_epoch, broker_state_set.key, broker_state_set.value)
    ON CONFLICT ON CONSTRAINT state_pkey
    DO UPDATE SET value = excluded.value, updated_at = clock_timestamp();
END
$$;
COMMENT ON FUNCTION pgbroker.broker_state_set(text, text, jsonb) IS
    'Holder only (PB001 otherwise): set KEY to VALUE in the state of lease NAME. The next claim starts with an empty state.';

CREATE FUNCTION pgbroker.broker_state_delete(name text, key text)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_epoch bigint := pgbroker._holder_epoch(broker_state_delete.name);
BEGIN
    DELETE FROM pgbroker.state s
     WHERE s.name = broker_state_delete.name AND s.epoch = v_epoch AND s.key = broker_state_delete.key;
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION pgbroker.broker_state_delete(text, text) IS
    'Holder only (PB001 otherwise): delete KEY from the state of lease NAME; false when it was not set.';

CREATE FUNCTION pgbroker.lease_history_prune(older_than interval DEFAULT '30 days')
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_count bigint;
BEGIN
    IF older_than IS NULL OR older_than < '0'::interval THEN
        RAISE EXCEPTION 'older_than must be a non-negative interval' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    DELETE FROM pgbroker.lease_event WHERE at < clock_timestamp() - older_than;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION pgbroker.lease_history_prune(interval) IS
    'pgbroker_admin: delete lease history events older than OLDER_THAN; returns how many.';
