-- pgbroker: the outbox, wake-ups and delivery.
--
-- The watch triggers (600_triggers.sql) write one outbox row per changed row
-- and live broker, carrying the clients to tell (or NULL: resolved when
-- fetched, for the changes of REPEATABLE READ and SERIALIZABLE writers and
-- those written while a subscribe was under way).  The broker drains its rows with
-- outbox_fetch() and acknowledges them; while it drains it is "awake" and
-- writers send no NOTIFY, and when it runs out of work it goes to sleep with
-- broker_sleep(), after which the next writer wakes it with pg_notify on
-- wakeup_channel(name).

-- UNLOGGED: no WAL for the hot path.  Crash recovery empties it, and a
-- promoted standby has it empty; both end every broker session, so the next
-- claim starts a new epoch whose clients re-subscribe and re-read.  Rows of
-- an earlier epoch than the lease's are never fetched; broker_sweep()
-- deletes them.  Safe after a promotion because nothing in it must survive
-- one, and it has no state whose loss blocks writers: its ids come from a
-- LOGGED sequence (below), not from an identity column.
--
-- The sequence of its ids is LOGGED on purpose.  An identity column of an
-- UNLOGGED table gets an UNLOGGED sequence (PostgreSQL 15 and later), and
-- on PostgreSQL 15 (seen on 15.18; not on 15.20 nor 18.6) a standby that
-- replayed the sequence's creation and made no restartpoint since is
-- promoted with an all-zero sequence page: every nextval(), so every write
-- to a watched table, then fails with "bad magic number in sequence"
-- (XX000) until a checkpoint and a crash restart (issue 26;
-- tests/faults/test_failover_unlogged.py).  A logged sequence is
-- replicated like any table; it writes WAL once every 32 values, and the
-- writer's transaction writes WAL for its own change anyway.  A sequence of
-- its own (not an identity column made LOGGED) keeps its persistence
-- through pg_dump and restore.
CREATE SEQUENCE pgbroker.outbox_id_seq AS bigint;
COMMENT ON SEQUENCE pgbroker.outbox_id_seq IS
    'Ids of pgbroker.outbox rows. LOGGED although the outbox is UNLOGGED: an unlogged sequence can come out of a promotion unusable (sql/500_outbox.sql).';
CREATE UNLOGGED TABLE pgbroker.outbox (
    -- Unique by its sequence; indexed with the broker's name and epoch only
    -- (below): every index is one more hot page that all writers insert into.
    id bigint NOT NULL DEFAULT pg_catalog.nextval('pgbroker.outbox_id_seq'::pg_catalog.regclass),
    name text NOT NULL,
    epoch bigint NOT NULL,
    watch_id integer NOT NULL,
    op "char" NOT NULL,
    row_key jsonb,
    changed text[],
    clients text[],
    at timestamptz NOT NULL DEFAULT pg_catalog.statement_timestamp(),
    -- Tables with filters (350_filters.sql): which of the clients saw the row
    -- leave their filters, and, for rows resolved when fetched, the row's
    -- filter points before and after the change.
    left_clients text[],
    new_points jsonb[],
    old_points jsonb[]
);
-- A fetch reads one epoch's rows in id order, never an earlier epoch's.
CREATE INDEX outbox_name_epoch_id ON pgbroker.outbox (name, epoch, id);
-- The rows whose clients are resolved at fetch time (none but under
-- REPEATABLE READ and SERIALIZABLE writers, or while a subscribe is under
-- way), oldest first: a fetch returns no row past the first of them.
CREATE INDEX outbox_unresolved ON pgbroker.outbox (name, epoch, id) WHERE clients IS NULL;
-- A queue table: every row is deleted soon after it is written, and a fetch
-- walks the dead index entries until VACUUM removes them (measured: an empty
-- fetch over 70,000 dead rows takes 3.5 ms instead of 0.13 ms).  Let
-- autovacuum visit it as soon as it holds a few thousand dead rows.
ALTER TABLE pgbroker.outbox SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000,
                                 autovacuum_vacuum_cost_delay = 0);
COMMENT ON TABLE pgbroker.outbox IS
    'Notification targets written by the watch triggers: one row per changed row and broker. UNLOGGED (sql/README.md, "Server crash and failover"). Internal: use outbox_fetch() / outbox_ack().';
COMMENT ON COLUMN pgbroker.outbox.id IS 'Increasing; for one row of a watched table, in commit order.';
COMMENT ON COLUMN pgbroker.outbox.name IS 'Broker (lease name) to deliver to.';
COMMENT ON COLUMN pgbroker.outbox.epoch IS 'Epoch of that broker when the change was written.';
COMMENT ON COLUMN pgbroker.outbox.watch_id IS 'The watched table.';
COMMENT ON COLUMN pgbroker.outbox.op IS 'I insert, U update, D delete, T truncate.';
COMMENT ON COLUMN pgbroker.outbox.row_key IS 'Key of the changed row (NULL for T).';
COMMENT ON COLUMN pgbroker.outbox.changed IS 'For U: the names of the columns whose value changed; NULL otherwise.';
COMMENT ON COLUMN pgbroker.outbox.clients IS 'client_ids of the clients to tell; NULL: whoever is subscribed when the row is fetched (see 600_triggers.sql).';
COMMENT ON COLUMN pgbroker.outbox.at IS 'Start of the statement that made the change.';
COMMENT ON COLUMN pgbroker.outbox.left_clients IS 'Those of the clients whose filters the row matched before the change (U) and none of whose subscriptions it matches after: the row left them. NULL: none.';
COMMENT ON COLUMN pgbroker.outbox.new_points IS 'Rows whose clients are resolved when fetched, of a table with filters: the row''s filter points after the change (before it, for D).';
COMMENT ON COLUMN pgbroker.outbox.old_points IS 'Same: the row''s filter points before an update (its clients that match none of the rest are told the row left).';

-- ---------------------------------------------------------------------------
-- Lock classes (first key of two-int4 advisory locks; second: see each).
CREATE FUNCTION pgbroker._lock_class_drain()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823607 $$;
COMMENT ON FUNCTION pgbroker._lock_class_drain() IS
    'Internal: ''pgbw''; (class, _lock_gate(lease lock_key)) is taken shared by writers that wake a broker, and broker_sleep() takes every gate of it exclusively.';

CREATE FUNCTION pgbroker._lock_class_awake()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823585 $$;
COMMENT ON FUNCTION pgbroker._lock_class_awake() IS
    'Internal: ''pgba''; (class, _epoch_key(epoch)) is held (session level) by the holder of a session lease''s epoch while it is awake and draining.';

-- ---------------------------------------------------------------------------
-- Wake-ups.
--
-- A broker that is awake holds the session-level "awake" lock of its epoch
-- and drains the outbox; writers see that and do not NOTIFY (every NOTIFY
-- serialises commits on a cluster-wide lock).  Writers take the "drain" lock
-- shared, held to commit, before they look: their own gate of it, one of 16
-- by their pid (300_watched_tables.sql), so that writers do not all meet on
-- one lock tag.  To go to sleep the broker takes every gate exclusively,
-- waiting until no writer holds it (tries, never a queued request, so
-- writers go on seeing it awake meanwhile; those whose gate it took already
-- notify, which it may find pending once asleep, an early wake-up and no
-- more), releases "awake" and looks at the outbox once more: a writer
-- either committed before that last look, or found its gate taken or
-- "awake" free and notifies.  This holds at every
-- isolation level, because the "awake" test is a lock, not a row a snapshot
-- could hide.  Keyed by the epoch, an awake broker's lock also tells writers
-- that its epoch's holder is alive (600_triggers.sql): no lock test of its
-- own per broker and statement while the broker drains.

CREATE FUNCTION pgbroker.wakeup_channel(name text DEFAULT 'default')
RETURNS text
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pgbroker._name_check('lease', wakeup_channel.name, false);
    SELECT 'pgbroker_wakeup_' || lock_key FROM pgbroker.lease WHERE lease.name = wakeup_channel.name;
$$;
COMMENT ON FUNCTION pgbroker.wakeup_channel(text) IS
$$The LISTEN channel on which the broker of lease NAME is woken: 'pgbroker_wakeup_' followed by the lease's number
(never user text, so no quoting or length issue); the payload is the lease name. NULL before the first claim.$$;

-- Whether the holder of epoch P_EPOCH of the lease numbered P_LOCK_KEY is
-- alive: its "held" lock is taken (a try that fails: 100_lease.sql), or this
-- very session holds that epoch (its own locks never conflict with it).
-- The triggers ask only when the broker is not awake (600_triggers.sql).
CREATE FUNCTION pgbroker._epoch_alive(p_lock_key integer, p_epoch bigint)
RETURNS boolean
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_alive(), pgbroker._epoch_key(p_epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_alive(), pgbroker._epoch_key(p_epoch))
                     AND EXISTS (SELECT FROM pgbroker.lease h
                                  WHERE h.lock_key = p_lock_key AND h.epoch = p_epoch AND h.state = 'held'
                                    AND h.holder_pid = pg_backend_pid()
                                    AND h.holder_backend_start = pgbroker._my_backend_start())
                ELSE true END
$$;
COMMENT ON FUNCTION pgbroker._epoch_alive(integer, bigint) IS
    'Internal: whether a session holds epoch p_epoch of the lease numbered p_lock_key (its alive lock is taken, or it is this session).';

CREATE FUNCTION pgbroker._awake_held(p_key integer)
RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (SELECT FROM pg_catalog.pg_locks l
                    WHERE l.locktype = 'advisory' AND l.pid = pg_catalog.pg_backend_pid() AND l.granted
                      AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())
                      AND l.classid = pgbroker._lock_class_awake()::oid AND l.objid = p_key::oid AND l.objsubid = 2
                      AND l.mode = 'ExclusiveLock')
$$;
COMMENT ON FUNCTION pgbroker._awake_held(integer) IS 'Internal: whether this session holds the awake lock (class, p_key), p_key an _epoch_key().';

CREATE FUNCTION pgbroker.broker_wake(name text DEFAULT 'default')
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(broker_wake.name);
    v_epoch bigint;
    v_key integer;
BEGIN
    v_epoch := pgbroker._holder_epoch(v_name);
    v_key := pgbroker._epoch_key(v_epoch);
    IF NOT pgbroker._awake_held(v_key) THEN
        PERFORM pg_advisory_lock(pgbroker._lock_class_awake(), v_key);
    END IF;
END
$$;
COMMENT ON FUNCTION pgbroker.broker_wake(text) IS
$$Holder only: declare the broker of lease NAME awake and draining, so writers stop sending NOTIFYs.
Idempotent. Call it before draining with outbox_fetch(); call broker_sleep() when the outbox is empty.$$;

CREATE FUNCTION pgbroker.broker_sleep(name text DEFAULT 'default', wait interval DEFAULT '20 ms')
RETURNS text
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off  -- see outbox_fetch()
SET enable_bitmapscan = off
AS $$
DECLARE
    v_name text := pgbroker._check_name(broker_sleep.name);
    v_epoch bigint := pgbroker._holder_epoch(v_name);
    v_wait_ms text := pgbroker._wait_ms(broker_sleep.wait);   -- checked before anything changes
    v_deadline timestamptz := CASE WHEN broker_sleep.wait IS NULL THEN 'infinity'
                                   ELSE clock_timestamp() + (v_wait_ms || ' ms')::interval END;
    v_floor bigint;
    v_key integer;
    v_gate_key integer;
    v_awake integer := pgbroker._epoch_key(v_epoch);
BEGIN
    SELECT lock_key INTO v_key FROM pgbroker.lease l WHERE l.name = v_name;
    -- Wait, still awake, until no writer holds a gate of the drain lock, and
    -- take them all: by tries, so that writers never find a request of ours
    -- queued (they would take it for a broker going to sleep, and NOTIFY),
    -- and all or none (a gate held while another is waited for would tell
    -- its writers the same), at most WAIT (a long writer transaction must
    -- not keep us from draining).
    LOOP
        BEGIN
            FOR v_gate_key IN SELECT pgbroker._lock_gate_key(v_key, g) FROM generate_series(0, pgbroker._lock_gates() - 1) g
                              UNION ALL SELECT v_key LOOP  -- and the key itself (300_watched_tables.sql)
                IF NOT pg_try_advisory_xact_lock(pgbroker._lock_class_drain(), v_gate_key) THEN
                    RAISE EXCEPTION USING ERRCODE = 'lock_not_available';  -- gives back the gates taken
                END IF;
            END LOOP;
            EXIT;
        EXCEPTION WHEN lock_not_available THEN
            IF clock_timestamp() >= v_deadline THEN
                IF NOT pgbroker._awake_held(v_awake) THEN
                    PERFORM pg_advisory_lock(pgbroker._lock_class_awake(), v_awake);
                END IF;
                RETURN 'busy';
            END IF;
            PERFORM pg_sleep(0.001);
        END;
    END LOOP;
    -- Every gate of the drain lock is ours until this returns: writers from now on NOTIFY.
    IF pgbroker._awake_held(v_awake) THEN
        PERFORM pg_advisory_unlock(pgbroker._lock_class_awake(), v_awake);
    END IF;
    v_floor := pgbroker._outbox_floor(v_name, v_epoch, false);
    IF EXISTS (SELECT FROM pgbroker.outbox o WHERE o.name = v_name AND o.epoch = v_epoch AND o.id > v_floor) THEN
        PERFORM pg_advisory_lock(pgbroker._lock_class_awake(), v_awake);
        RETURN 'pending';
    END IF;
    RETURN 'asleep';
END
$$;
COMMENT ON FUNCTION pgbroker.broker_sleep(text, interval) IS
$$Holder only: declare the broker of lease NAME asleep, so that the next writer NOTIFYs it. Call it in autocommit mode.
Returns 'asleep' (outbox empty: LISTEN on wakeup_channel(NAME) and wait), 'pending' (rows arrived: still awake, fetch again)
or 'busy' (a writer transaction still open after WAIT: still awake; poll again soon).$$;

-- A broker that ends its epoch awake (a release, or a new claim of its own
-- session) stops being awake for that epoch when this commits: its lock
-- would otherwise tell writers the epoch is alive (600_triggers.sql).
CREATE FUNCTION pgbroker._awake_end()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF (NEW.state <> 'held' OR NEW.epoch <> OLD.epoch)
       AND OLD.holder_pid = pg_backend_pid() AND pgbroker._awake_held(pgbroker._epoch_key(OLD.epoch)) THEN
        PERFORM pg_advisory_unlock(pgbroker._lock_class_awake(), pgbroker._epoch_key(OLD.epoch));
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._awake_end() IS
    'Internal deferred trigger: at commit, a session whose epoch ended (released, or replaced by its own new claim) drops its awake lock of that epoch.';

CREATE CONSTRAINT TRIGGER _500_awake_end
    AFTER UPDATE OF epoch, state ON pgbroker.lease
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION pgbroker._awake_end();
COMMENT ON TRIGGER _500_awake_end ON pgbroker.lease IS
    'Drops the awake lock of an epoch its own session ended, when the transaction commits.';

-- ---------------------------------------------------------------------------
-- Delivery.

-- Where a fetch can start.  Acknowledged rows leave dead index entries
-- behind until VACUUM, and a scan from the start of a broker's rows walks
-- them all (an empty fetch over 70,000 dead rows: 3.5 ms instead of 0.1 ms).
-- So each broker session keeps a floor F: no row with id <= F will ever need
-- fetching.  Now and then a fetch reads S, the outbox sequence's value, and
-- only then takes an xid X of its own.  An outbox row is only ever written
-- after its transaction's first write, so a row with id <= S belongs to a
-- transaction whose xid is below X.  Once every xid below X has ended (X is
-- below the current xmin), such a row is visible or gone for good, and F
-- may rise to S, never past a row still waiting.  The state lives in the
-- setting pgbroker.outbox_floor ('epoch:F:S:X:when'); a rolled-back fetch
-- only makes it more conservative.  (A snapshot's xmax is not a substitute
-- for X: it omits running transactions whose xid is above the last one to
-- complete.)
CREATE FUNCTION pgbroker._outbox_floor(p_name text, p_epoch bigint, p_advance boolean)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    v_state text[] := string_to_array(current_setting('pgbroker.outbox_floor', true), ':');
    v_floor bigint := 0;
    v_s bigint;
    v_x xid8;
    v_when timestamptz;
    v_first bigint;
    v_dirty boolean := true;  -- the setting needs writing (unset, or another epoch's)
BEGIN
    -- Most calls: this epoch's state, nothing to move (no X taken, or X not
    -- yet below the oldest running transaction), no new (S, X) due.
    IF v_state[1] = p_epoch::text AND cardinality(v_state) = 5
       AND (NOT p_advance OR current_setting('transaction_isolation') <> 'read committed'
            OR CASE WHEN v_state[4] <> '' THEN v_state[4]::xid8 >= pg_snapshot_xmin(pg_current_snapshot())
                    ELSE pg_current_xact_id_if_assigned() IS NOT NULL
                         OR to_timestamp(nullif(v_state[5], '')::double precision)
                            >= clock_timestamp() - interval '100 ms' END) THEN
        RETURN v_state[2]::bigint;
    END IF;
    IF v_state[1] = p_epoch::text AND cardinality(v_state) = 5 THEN
        v_dirty := false;
        v_floor := v_state[2]::bigint;
        v_s := nullif(v_state[3], '')::bigint;
        v_x := nullif(v_state[4], '')::xid8;
        v_when := to_timestamp(nullif(v_state[5], '')::double precision);
    END IF;
    IF NOT p_advance OR current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN v_floor;
    END IF;
    IF v_x IS NOT NULL AND v_x < pg_snapshot_xmin(pg_current_snapshot()) THEN
        SELECT min(o.id) INTO v_first FROM pgbroker.outbox o
         WHERE o.name = p_name AND o.epoch = p_epoch AND o.id > v_floor;
        v_floor := greatest(v_floor, least(v_s, v_first - 1));
        v_x := NULL;
        v_dirty := true;
    END IF;
    -- A new (S, X) needs an xid taken after reading S: only in a transaction
    -- that has none yet, and at most every 100 ms (each costs an xid).
    IF v_x IS NULL AND pg_current_xact_id_if_assigned() IS NULL
       AND (v_when IS NULL OR v_when < clock_timestamp() - interval '100 ms') THEN
        -- The last id handed out, read without a scan of the sequence:
        -- that scan has no index path, so under the readers' plan pins
        -- (see outbox_fetch) it would be disabled, and JIT-compiled.
        -- NULL (never called): 0, which only keeps the floor where it is.
        v_s := coalesce(pg_sequence_last_value('pgbroker.outbox_id_seq'::regclass), 0);
        v_x := pg_current_xact_id();
        v_when := clock_timestamp();
        v_dirty := true;
    END IF;
    IF v_dirty THEN
        PERFORM set_config('pgbroker.outbox_floor',
                           concat_ws(':', p_epoch, v_floor, coalesce(v_s::text, ''), coalesce(v_x::text, ''),
                                     coalesce(extract(epoch FROM v_when)::text, '')),
                           false);
    END IF;
    RETURN v_floor;
END
$$;
COMMENT ON FUNCTION pgbroker._outbox_floor(text, bigint, boolean) IS
    'Internal: the id below which this broker session''s outbox scans can start (see the comment above it in sql/500_outbox.sql); p_advance moves it up when that is safe.';

-- Rows written while a subscribe was under way name no clients (NULL):
-- whoever is subscribed when they are fetched is told.  Resolved in place;
-- a row left with nobody is deleted.
CREATE FUNCTION pgbroker._outbox_resolve(p_name text, p_epoch bigint)
RETURNS void
LANGUAGE sql
AS $$
    WITH resolved AS MATERIALIZED (
        SELECT o.ctid AS row_ctid,
               -- A row's subscribers by two probes, each on the interest's whole key.  (An OR
               -- with the truncate's case, or row_key IN (key, null), let a plan made on the
               -- statistics of an interest loaded since read the broker's whole interest of
               -- the table for each row: 51 ms a row at 30,000 keys, and the broker fell
               -- behind its writers while clients churned.)
               CASE WHEN o.new_points IS NOT NULL THEN coalesce(f.clients, '{}')
                    WHEN o.op = 'T'
                    THEN ARRAY(SELECT DISTINCT s FROM pgbroker.interest i, unnest(i.clients) AS s
                                WHERE i.watch_id = o.watch_id AND i.name = p_name AND i.epoch = p_epoch
                                ORDER BY 1)
                    ELSE ARRAY(SELECT DISTINCT s
                                 FROM (SELECT i.clients FROM pgbroker.interest i
                                        WHERE i.watch_id = o.watch_id AND i.row_key = o.row_key
                                          AND i.name = p_name AND i.epoch = p_epoch
                                       UNION ALL
                                       SELECT i.clients FROM pgbroker.interest i
                                        WHERE i.watch_id = o.watch_id AND i.row_key = 'null'::jsonb
                                          AND i.name = p_name AND i.epoch = p_epoch) q,
                                      unnest(q.clients) AS s
                                ORDER BY 1) END AS clients,
               f.left_clients
          FROM pgbroker.outbox o
          -- A row of a table with filters: the subscribers of its key, of the whole table and of the keys its
          -- points match after the change, and those of the keys its points before it match only, who saw it
          -- leave (as the triggers do).
          LEFT JOIN LATERAL (
               SELECT array_agg(m.c ORDER BY m.c) AS clients, array_agg(m.c ORDER BY m.c) FILTER (WHERE m.gone) AS left_clients
                 FROM (SELECT x.c, bool_and(p.old) AS gone
                         FROM (SELECT q.key, bool_and(q.old) AS old
                                 FROM (SELECT k, false
                                         FROM unnest(pgbroker._filter_keys(o.watch_id, o.new_points) || ARRAY[o.row_key, 'null'::jsonb]) AS k
                                       UNION ALL
                                       SELECT k, true FROM unnest(pgbroker._filter_keys(o.watch_id, o.old_points)) AS k) AS q (key, old)
                                GROUP BY q.key) p
                         JOIN pgbroker.interest i
                           ON i.watch_id = o.watch_id AND i.row_key = p.key AND i.name = p_name AND i.epoch = p_epoch
                        CROSS JOIN LATERAL unnest(i.clients) AS x(c)
                        GROUP BY x.c) m
                WHERE o.new_points IS NOT NULL) f ON true
         WHERE o.name = p_name AND o.epoch = p_epoch AND o.clients IS NULL
    ), told AS (
        -- Each row by its ctid (only this broker's session changes its rows): joined by (name, id), or
        -- (name, epoch, id) on the plan of a generic estimate of one row, each was looked for among all the
        -- epoch's rows, O(n^2): a fetch ran for minutes over 13,000 rows written while subscribes churned.
        UPDATE pgbroker.outbox o SET clients = r.clients, left_clients = r.left_clients
          FROM resolved r
         WHERE o.ctid = r.row_ctid AND r.clients <> '{}'
    )
    DELETE FROM pgbroker.outbox d USING resolved r WHERE d.ctid = r.row_ctid AND r.clients = '{}';
$$;
COMMENT ON FUNCTION pgbroker._outbox_resolve(text, bigint) IS
    'Internal: give the outbox rows of a broker written with clients NULL the clients subscribed now; drop those with none.';

-- The broker calls it in a loop, so its cost per call and per row is the
-- broker's cost: planned once per session (re-planning cost more than the
-- fetch itself: a one-row fetch 224 us re-planned, 85 us with the generic
-- plan), and as few statements as a call allows, each paying a snapshot:
-- one finds the holder's epoch, whether any row awaits its clients, whether
-- any departure must be applied and whether name grants apply (the name
-- check runs only then, or for the error of a caller that does not hold
-- the lease), one acknowledges the previous batch and returns the next (the
-- rows it deletes are left out of those it returns).  Rows are returned as the
-- triggers wrote them: client ids, nothing looked up per row but the
-- table's name.  Rows written with clients NULL (by REPEATABLE READ and
-- SERIALIZABLE writers, and while a subscribe was under way) are resolved
-- first, and those left with nobody to tell are deleted rather than
-- returned.  Each statement sees the rows committed before it started, so
-- a writer may commit an unresolved row after the resolving statement and
-- before the last one: the last returns only the rows before the first
-- unresolved row it sees (an index probe, normally on nothing), and the
-- next call resolves that one.  So no row is returned without its clients,
-- and the rows of one row of a table still come in commit order.
--
-- Its plans, and outbox_ack()'s and broker_sleep()'s, are held to the
-- indexes (enable_seqscan and enable_bitmapscan off): the outbox's
-- statistics are those of the moment autovacuum last looked (a few live
-- rows on the pages a minute of churn left), every vacuum invalidates the
-- plans made on them, and the next may be a sequential scan of every page
-- per call, or a bitmap scan.  Neither marks the dead index entries it
-- passes as dead, as an index scan does, so the indexes then bloat: in
-- bench_endurance.py --no-data, outbox_name_epoch_id went from 16 kB to
-- 2.4 MB in the minute after the ack's plan turned to a sequential scan.
-- The pins decide speed only, never what a statement returns: the
-- wake-up handshake holds whatever the plans (tests/test_wakeup.py breaks
-- it on purpose to show the test sees it).  Every statement these
-- functions run, their helpers' too, must have an index path: PostgreSQL
-- 15 to 17 cost a disabled scan at disable_cost (1e10), far past
-- jit_above_cost, so a statement with none is JIT-compiled at every plan
-- (a test asserts that no plan of the broker loop is disabled or
-- compiled).
CREATE FUNCTION pgbroker.outbox_fetch(name text DEFAULT 'default', max_rows integer DEFAULT 1000, ack bigint[] DEFAULT NULL)
RETURNS TABLE (id bigint, "table" text, op text, key jsonb, changed text[], clients text[], at timestamptz,
               "left" text[])
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    v_epoch bigint;
    v_unresolved boolean;
    v_departed boolean;
    v_granted boolean;
    v_floor bigint;
BEGIN
    -- The holder's epoch, whether rows await their clients, whether the
    -- lease names have grants, the floor when it has nothing to move (as
    -- _outbox_floor's first test: NULL otherwise, and _outbox_floor runs),
    -- and whether a departure may hide a client from rows past it (past 0
    -- when the floor is not known yet: the departures' path, slower, is
    -- right whatever they hide).
    SELECT l.epoch, EXISTS (SELECT FROM pgbroker.outbox u WHERE u.name = l.name AND u.epoch = l.epoch AND u.clients IS NULL),
           EXISTS (SELECT FROM pgbroker.outbox_departed d
                    WHERE d.name = l.name AND d.epoch = l.epoch AND d.last_id > coalesce(x.floor, 0)),
           EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease'),
           x.floor
      INTO v_epoch, v_unresolved, v_departed, v_granted, v_floor
      FROM pgbroker.lease l,
           (SELECT string_to_array(current_setting('pgbroker.outbox_floor', true), ':') AS s) f,
           LATERAL (SELECT CASE WHEN f.s[1] = l.epoch::text AND cardinality(f.s) = 5
                                     AND current_setting('transaction_isolation') = 'read committed'
                                     AND CASE WHEN f.s[4] <> '' THEN f.s[4]::xid8 >= pg_snapshot_xmin(pg_current_snapshot())
                                              ELSE to_timestamp(nullif(f.s[5], '')::double precision)
                                                   >= clock_timestamp() - interval '100 ms' END
                                THEN f.s[2]::bigint END AS floor) x
     WHERE l.name = outbox_fetch.name AND l.state = 'held' AND l.expires_at IS NULL
       AND l.holder_pid = pg_backend_pid() AND l.holder_backend_start = pgbroker._my_backend_start();
    IF v_epoch IS NULL OR v_granted THEN
        PERFORM pgbroker._name_check('lease', outbox_fetch.name, true);
    END IF;
    IF v_epoch IS NULL THEN
        v_epoch := pgbroker._holder_epoch(outbox_fetch.name);  -- raises the error that applies (bad name, PB001)
    END IF;
    IF outbox_fetch.max_rows IS NULL OR outbox_fetch.max_rows < 1 THEN
        RAISE EXCEPTION 'max_rows must be at least 1' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF v_floor IS NULL THEN
        -- First, before this transaction writes anything (see _outbox_floor).
        v_floor := pgbroker._outbox_floor(outbox_fetch.name, v_epoch, true);
    END IF;
    IF v_unresolved THEN
        PERFORM pgbroker._outbox_resolve(outbox_fetch.name, v_epoch);
    END IF;
    -- Rows that may name clients unregistered since: fetched without them (_outbox_fetch_departed).
    IF v_departed THEN
        RETURN QUERY SELECT * FROM pgbroker._outbox_fetch_departed(outbox_fetch.name, v_epoch, v_floor, outbox_fetch.max_rows,
                                                                   outbox_fetch.ack);
        RETURN;
    END IF;
    RETURN QUERY
    WITH acked AS (  -- the previous batch, acknowledged in the same round trip
        DELETE FROM pgbroker.outbox b
         WHERE b.name = outbox_fetch.name AND b.epoch = v_epoch AND b.id = ANY (outbox_fetch.ack)
    )
    SELECT o.id, (SELECT w.relid::regclass::text FROM pgbroker.watched w WHERE w.watch_id = o.watch_id),
           o.op::text, o.row_key, o.changed, o.clients, o.at, o.left_clients
      FROM pgbroker.outbox o
     WHERE o.name = outbox_fetch.name AND o.epoch = v_epoch AND o.id > v_floor
       AND (outbox_fetch.ack IS NULL OR o.id <> ALL (outbox_fetch.ack))
       AND o.id < COALESCE((SELECT min(u.id) FROM pgbroker.outbox u
                             WHERE u.name = outbox_fetch.name AND u.epoch = v_epoch AND u.clients IS NULL),
                           9223372036854775807)
     ORDER BY o.id
     LIMIT outbox_fetch.max_rows;
END
$$;
COMMENT ON FUNCTION pgbroker.outbox_fetch(text, integer, bigint[]) IS
$$Holder only: up to MAX_ROWS pending notifications of lease NAME, oldest first (for any one row: in commit order).
Each: id, table, op (I/U/D/T), key (jsonb, NULL for T), changed (column names, for U), clients (client ids to tell, each
once, never empty), at, left (those of the clients that the row left: their filters matched it before this update and
none of their subscriptions matches it after; NULL when none).
Rows stay until acknowledged, by outbox_ack() or by passing their ids as ACK to the next outbox_fetch() (one round
trip less): at-least-once delivery within the epoch.$$;

CREATE FUNCTION pgbroker.outbox_ack(name text, ids bigint[])
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    v_name text := pgbroker._check_name(outbox_ack.name);
    v_epoch bigint := pgbroker._holder_epoch(v_name);
    v_count bigint;
BEGIN
    DELETE FROM pgbroker.outbox o WHERE o.name = v_name AND o.epoch = v_epoch AND o.id = ANY (outbox_ack.ids);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION pgbroker.outbox_ack(text, bigint[]) IS
    'Holder only: acknowledge (delete) delivered notifications IDS of lease NAME; returns how many.';

-- ---------------------------------------------------------------------------
-- Unregistered clients are left out of the notifications still pending for
-- them when those are fetched, not struck from them when they leave: a
-- departure costs one row here whatever the backlog (striking it read every
-- pending row of the epoch: 164 ms per unregister over 100,000 rows, issue
-- 45).  A departure hides its client from the rows up to LAST_ID, the outbox
-- sequence's value when it was recorded: a writer that read the interest
-- after the unregister committed takes a later id, so a client registered
-- again under the same id hears of the changes after that.  A writer
-- transaction that read the interest before the unregister committed may
-- still name it in a later row: a broker ignores ids it no longer knows.
-- UNLOGGED like the outbox, whose rows it qualifies; a fetch deletes the
-- departures its floor has passed (no row they hide is left to fetch), the
-- sweep those of earlier epochs.
CREATE UNLOGGED TABLE pgbroker.outbox_departed (
    name text NOT NULL,
    epoch bigint NOT NULL,
    client_id text NOT NULL,
    last_id bigint NOT NULL,
    PRIMARY KEY (name, epoch, client_id)
);
-- The primary key is the only index: with a second one on (name, epoch,
-- last_id), a generic plan of the fetch's probe per client took the range
-- last_id >= id over every departure of the epoch, for each client of each
-- row (a fetch ran for minutes under churn).  The fetch reads the epoch's
-- departures above its floor whole, and they are few (those of the last
-- moments).
COMMENT ON TABLE pgbroker.outbox_departed IS
    'Internal: clients unregistered while notifications naming them may be pending; outbox_fetch() leaves them out of those rows.';
COMMENT ON COLUMN pgbroker.outbox_departed.name IS 'The broker (lease name) of the client.';
COMMENT ON COLUMN pgbroker.outbox_departed.epoch IS 'Its epoch.';
COMMENT ON COLUMN pgbroker.outbox_departed.client_id IS 'The unregistered client.';
COMMENT ON COLUMN pgbroker.outbox_departed.last_id IS 'The outbox rows with ids up to this one are fetched without the client.';

-- outbox_fetch() while departures are recorded above its floor: the same
-- rows, each client departed after the row was written left out (a probe
-- per client of the rows up to the last departure), and the rows left with
-- nobody deleted instead of returned.  Runs with outbox_fetch()'s settings.
CREATE FUNCTION pgbroker._outbox_fetch_departed(p_name text, p_epoch bigint, p_floor bigint, p_max_rows integer,
                                                p_ack bigint[])
RETURNS TABLE (id bigint, "table" text, op text, key jsonb, changed text[], clients text[], at timestamptz,
               "left" text[])
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_upto bigint;
BEGIN
    DELETE FROM pgbroker.outbox_departed d WHERE d.name = p_name AND d.epoch = p_epoch AND d.last_id <= p_floor;
    SELECT max(d.last_id) INTO v_upto FROM pgbroker.outbox_departed d WHERE d.name = p_name AND d.epoch = p_epoch;
    RETURN QUERY
    WITH acked AS (
        DELETE FROM pgbroker.outbox b
         WHERE b.name = p_name AND b.epoch = p_epoch AND b.id = ANY (p_ack)
    ), batch AS MATERIALIZED (
        SELECT o.id, o.watch_id, o.op, o.row_key, o.changed, o.at,
               CASE WHEN o.id > v_upto OR o.left_clients IS NULL THEN o.left_clients
                    ELSE ARRAY(SELECT x.c FROM unnest(o.left_clients) WITH ORDINALITY AS x(c, n)
                                WHERE NOT EXISTS (SELECT FROM pgbroker.outbox_departed d
                                                   WHERE d.name = p_name AND d.epoch = p_epoch AND d.client_id = x.c
                                                     AND d.last_id >= o.id)
                                ORDER BY x.n) END AS left_clients,
               CASE WHEN o.id > v_upto THEN o.clients
                    ELSE ARRAY(SELECT x.c FROM unnest(o.clients) WITH ORDINALITY AS x(c, n)
                                WHERE NOT EXISTS (SELECT FROM pgbroker.outbox_departed d
                                                   WHERE d.name = p_name AND d.epoch = p_epoch AND d.client_id = x.c
                                                     AND d.last_id >= o.id)
                                ORDER BY x.n) END AS clients
          FROM pgbroker.outbox o
         WHERE o.name = p_name AND o.epoch = p_epoch AND o.id > p_floor
           AND (p_ack IS NULL OR o.id <> ALL (p_ack))
           AND o.id < COALESCE((SELECT min(u.id) FROM pgbroker.outbox u
                                 WHERE u.name = p_name AND u.epoch = p_epoch AND u.clients IS NULL),
                               9223372036854775807)
         ORDER BY o.id
         LIMIT p_max_rows
    ), emptied AS (
        DELETE FROM pgbroker.outbox e
         WHERE e.name = p_name AND e.epoch = p_epoch AND e.id = ANY (ARRAY(SELECT b.id FROM batch b WHERE b.clients = '{}'))
    )
    SELECT b.id, (SELECT w.relid::regclass::text FROM pgbroker.watched w WHERE w.watch_id = b.watch_id),
           b.op::text, b.row_key, b.changed, b.clients, b.at, nullif(b.left_clients, '{}')
      FROM batch b
     WHERE b.clients <> '{}'
     ORDER BY b.id;
END
$$;
COMMENT ON FUNCTION pgbroker._outbox_fetch_departed(text, bigint, bigint, integer, bigint[]) IS
    'Internal: outbox_fetch() while clients departed (pgbroker.outbox_departed): the rows without them, those left with nobody deleted.';

-- Once per statement: client_unregister_many() deletes thousands at once.
CREATE FUNCTION pgbroker._outbox_forget_clients()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_last bigint;
BEGIN
    -- The last id handed out (NULL, never called: 0), read without a scan of the sequence.
    v_last := coalesce(pg_sequence_last_value('pgbroker.outbox_id_seq'::regclass), 0);
    -- (Clients of an earlier epoch: their rows are never fetched, and broker_sweep() deletes them.)
    INSERT INTO pgbroker.outbox_departed AS d (name, epoch, client_id, last_id)
    SELECT o.name, o.epoch, o.client_id, v_last
      FROM old_clients o
     WHERE o.epoch = (SELECT l.epoch FROM pgbroker.lease l WHERE l.name = o.name)
    ON CONFLICT (name, epoch, client_id) DO UPDATE SET last_id = excluded.last_id;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._outbox_forget_clients() IS
    'Internal (statement trigger): record the unregistered clients in pgbroker.outbox_departed; fetches leave them out of the rows pending then.';

CREATE TRIGGER _500_forget_client
AFTER DELETE ON pgbroker.client
REFERENCING OLD TABLE AS old_clients
FOR EACH STATEMENT EXECUTE FUNCTION pgbroker._outbox_forget_clients();
COMMENT ON TRIGGER _500_forget_client ON pgbroker.client IS 'An unregistered client is left out of the notifications pending for it when they are fetched.';
