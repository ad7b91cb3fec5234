-- pgbroker: subscriptions, and the interest the triggers read.
--
-- A client subscribes to one row of a watched table (by key) or to the whole
-- table.  pgbroker.subscription holds one row per (client, table, key);
-- pgbroker.interest aggregates them per (table, key, broker) into the array of
-- client ids that the triggers (600_triggers.sql) copy into the outbox, so a
-- changed row costs one index probe whatever the number of its subscribers,
-- and the broker's fetch hands the ids over without looking anything up.
--
-- No gap, and no writer ever waits for a subscriber: writers' triggers
-- try-lock the table's watch lock shared (never queueing) and hold it to
-- commit; subscribe() takes it exclusively, so it waits for the writers
-- already past their trigger (up to its WAIT) and every later writer either
-- sees the new interest or finds the lock taken and writes its changes with
-- the subscribers left to be resolved at fetch time (600_triggers.sql).
--
-- Subscriptions and interest belong to an epoch, as clients do: those of an
-- earlier epoch are invisible (the triggers write nothing for an epoch whose
-- holder is gone, the views and calls compare the epoch) until
-- broker_sweep() deletes them; a new epoch's rows never touch theirs.
-- subscribe_many() makes many subscriptions in one statement, for a broker
-- whose clients come back after a restart.

-- No foreign keys: their checks run once per inserted row, and a broker
-- that restarts inserts its subscriptions by the hundred thousand.  The
-- functions keep what they would: subscribe locks its clients' rows (FOR KEY
-- SHARE, so an unregister waits for it or goes first), a deleted client's
-- subscriptions go with it (trigger _400_drop_interest, below), unwatch()
-- deletes its table's.
CREATE TABLE pgbroker.subscription (
    client_key bigint NOT NULL,
    watch_id integer NOT NULL,
    row_key jsonb NOT NULL,
    subscribed_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    PRIMARY KEY (client_key, watch_id, row_key)
);
-- The primary key is the only index: every one more is paid by each of the
-- hundreds of thousands of rows a restarting broker inserts (unwatch() and
-- the watched_tables view read a table's subscriptions by a scan).
COMMENT ON TABLE pgbroker.subscription IS 'Which client is subscribed to which row (or, with key JSON null, to the whole table). Internal: use subscribe().';
COMMENT ON COLUMN pgbroker.subscription.client_key IS 'The client.';
COMMENT ON COLUMN pgbroker.subscription.watch_id IS 'The watched table.';
COMMENT ON COLUMN pgbroker.subscription.row_key IS 'The row''s key encoded as jsonb (sql/README.md, "Key encoding"), or JSON null for the whole table.';
COMMENT ON COLUMN pgbroker.subscription.subscribed_at IS 'When.';

-- The subscriptions aggregated per (table, key, broker): what the triggers
-- read.  One index probe per changed row, whatever the number of clients.
CREATE TABLE pgbroker.interest (
    watch_id integer NOT NULL,   -- no foreign key either (see subscription); unwatch() deletes its table's
    row_key jsonb NOT NULL,
    name text NOT NULL,
    -- In the key: a new epoch's subscribers get rows of their own beside the
    -- earlier epoch's, which the sweep deletes without anyone waiting for it.
    epoch bigint NOT NULL,
    -- The broker's lease lock_key, so that the triggers test whether it is
    -- alive and wake it without looking its lease up.
    lock_key integer NOT NULL,
    -- client_ids, not client_keys: what the broker needs, copied as is into
    -- the outbox (a lookup per client at fetch time cost the broker ~3 µs each).
    clients text[] NOT NULL,
    -- A range filter's box (pgbroker._range_box, 350_filters.sql); NULL
    -- for every other key.
    range_box box,
    PRIMARY KEY (watch_id, row_key, name, epoch)
)
-- Room on each page for a row's next version: a subscribe or an unregister
-- rewrites its row's clients, which no index holds, so the update is HOT
-- (no index entry to add) when the page has room.  Filled to the brim by a
-- restart's subscribe_many, every update cost two unique-index insertions.
-- Under half full, so that one statement can give every row of a page its
-- next version: a batch of subscribe_filters (or a mass departure) rewrites
-- every row it touches, often all of a page's, while their old versions
-- stay until it commits.  At 70%, a fifth of a restart's 100,000 updates
-- were not HOT, and the bulk cost ~10% more backend CPU (bench_filters).
WITH (fillfactor = 45);
-- The broker's rows (the sweep, a TRUNCATE, the fetch's resolution), and
-- the same key as the primary one in another order, UNIQUE: a statement that
-- names one row by its whole key is a unique probe by whichever index the
-- planner picks.  As (name, epoch) alone, right after subscribe_many() (no
-- ANALYZE yet) the planner took the rows of a new epoch for two and read
-- them all to shrink one client's ten (issue 45).
CREATE UNIQUE INDEX interest_name_epoch ON pgbroker.interest (name, epoch, watch_id, row_key);
-- The range filters' rows: which ranges contain a changed row's value,
-- in one probe (350_filters.sql).  SP-GiST, a quad tree of the boxes: a
-- probe among 1,000 ranges cost half of a GiST index's, which compares
-- the probe with every box of the leaf pages it reaches.
CREATE INDEX interest_range ON pgbroker.interest USING spgist (range_box) WHERE range_box IS NOT NULL;
COMMENT ON TABLE pgbroker.interest IS 'Internal: subscribed client_ids per watched row and broker, kept by subscribe/unsubscribe/client_unregister for the triggers.';
COMMENT ON COLUMN pgbroker.interest.watch_id IS 'The watched table.';
COMMENT ON COLUMN pgbroker.interest.row_key IS 'The row key (JSON null: whole table).';
COMMENT ON COLUMN pgbroker.interest.name IS 'The broker (lease name) of these clients.';
COMMENT ON COLUMN pgbroker.interest.epoch IS 'Its epoch: rows of an earlier epoch than the lease''s are invisible and swept by broker_sweep().';
COMMENT ON COLUMN pgbroker.interest.lock_key IS 'Its lease''s lock_key (liveness test and wake-up channel of the triggers).';
COMMENT ON COLUMN pgbroker.interest.clients IS 'client_ids of the subscribed clients, each once.';
COMMENT ON COLUMN pgbroker.interest.range_box IS 'For a range filter''s key: its bounds (x) and its table, column and other columns'' values (a hash, y), for the SP-GiST probe; NULL otherwise.';

-- The subscription keys a changed row's points P_POINTS match in watched
-- table P_WATCH_ID: each point of equality itself, and for each range
-- probe (350_filters.sql) the keys of the ranges that contain its value,
-- of any broker: one SP-GiST probe, the candidates compared exactly.  The
-- fetch probes the interest for these keys of the rows it resolves late
-- (the triggers make the same SP-GiST probe in their own statements).
CREATE FUNCTION pgbroker._filter_keys(p_watch_id integer, p_points jsonb[])
RETURNS jsonb[]
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT FROM unnest(p_points) AS p WHERE p ? '') THEN
        RETURN p_points;
    END IF;
    RETURN ARRAY(SELECT p FROM unnest(p_points) AS p WHERE NOT p ? ''
                 UNION
                 SELECT j.row_key
                   FROM unnest(p_points) AS p
                   JOIN pgbroker.interest j
                     ON j.range_box @> pgbroker._range_probe(p_watch_id, p) AND j.watch_id = p_watch_id
                    AND pgbroker._range_matches(j.row_key, p)
                  WHERE p ? '');
END
$$;
COMMENT ON FUNCTION pgbroker._filter_keys(integer, jsonb[]) IS
    'Internal: the subscription keys matched by a changed row''s filter points: the points of equality, and the keys of the ranges containing its range probes'' values.';

-- ---------------------------------------------------------------------------
-- Subscriptions.

-- The registry_channel() payload of a subscribe or unsubscribe (200_clients.sql).
CREATE FUNCTION pgbroker._registry_subscription_event(p_event text, p_name text, p_epoch bigint, p_client_id text,
                                                      p_table text, p_key jsonb)
RETURNS text
LANGUAGE sql IMMUTABLE
AS $$
    SELECT pg_catalog.json_build_object('event', p_event, 'name', p_name, 'epoch', p_epoch, 'client_id', p_client_id,
                                        'table', p_table, 'key', p_key)::text
$$;
COMMENT ON FUNCTION pgbroker._registry_subscription_event(text, text, bigint, text, text, jsonb) IS
    'Internal: the registry_channel() payload of a subscribe or unsubscribe (key JSON null: the whole table).';

-- Strike client_ids[i] from the interest row (watch_ids[i], row_keys[i],
-- names[i], epochs[i]), for every i, deleting the rows left with none.
-- Each row is found by a probe on its whole key (a LATERAL subquery the
-- planner cannot flatten into a join, so never a scan of a broker's
-- interest planned on stale statistics), once however many of its clients
-- leave, and locked there, in one order (two of these never wait for each
-- other in a cycle: one order of the keys, by their hashes); that pass
-- also computes each row's clients left, from the row as it was locked.
-- The next statements, with a snapshot taken after those locks, write
-- them by the rows' ctids: no second grouping, no second probe (a
-- departure of 10,000 clients with 10 subscriptions each: 1.7 s of CPU
-- when each statement grouped and probed again, 1.2 s so).
CREATE FUNCTION pgbroker._interest_shrink(p_watch_ids integer[], p_row_keys jsonb[], p_names text[], p_epochs bigint[],
                                          p_client_ids text[])
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_rows tid[];
    v_clients text[];  -- each row's clients left, as the text of a text[] (an array of arrays cannot be ragged)
BEGIN
    SELECT array_agg(x.row_ctid), array_agg(x.clients::text)
      INTO v_rows, v_clients
      FROM (SELECT u.watch_id, u.row_key, u.name, u.epoch, array_agg(u.client_id) AS gone
              -- (unnest in the select list: streamed to the sort, where unnest in FROM first wrote
              -- the pairs to a tuplestore, on disk past work_mem: 100,000 pairs, ~60 ms)
              FROM (SELECT unnest(p_watch_ids) AS watch_id, unnest(p_row_keys) AS row_key, unnest(p_names) AS name,
                           unnest(p_epochs) AS epoch, unnest(p_client_ids) AS client_id) u
             -- (jsonb compares slowly: sorting 100,000 keys took 0.4 s; their hashes first, the keys on a tie)
             GROUP BY u.watch_id, jsonb_hash(u.row_key), u.row_key, u.name, u.epoch
             ORDER BY u.watch_id, jsonb_hash(u.row_key), u.row_key, u.name, u.epoch) g
     CROSS JOIN LATERAL (
           -- Computed from the row as locked: FOR UPDATE re-reads a row
           -- changed since the statement's snapshot, and this with it.
           SELECT i.ctid AS row_ctid,
                  CASE WHEN cardinality(g.gone) = 1 THEN array_remove(i.clients, g.gone[1])
                       ELSE ARRAY(SELECT c.c FROM unnest(i.clients) AS c(c) WHERE c.c <> ALL (g.gone)) END AS clients
             FROM pgbroker.interest i
            WHERE i.watch_id = g.watch_id AND i.row_key = g.row_key AND i.name = g.name AND i.epoch = g.epoch
              FOR UPDATE) x;
    IF v_rows IS NULL THEN
        RETURN;
    END IF;
    -- Joined by ctid alone: a TID probe per row given, whatever the table's
    -- statistics say.  (With ctid = ANY (v_rows) as well, the generic plan
    -- scanned the TIDs and the unnest again for each: 30,000 rows took 5 s.)
    UPDATE pgbroker.interest i
       SET clients = r.clients::text[]
      FROM unnest(v_rows, v_clients) AS r(row_ctid, clients)
     WHERE i.ctid = r.row_ctid AND r.clients <> '{}';
    DELETE FROM pgbroker.interest i
     USING unnest(v_rows, v_clients) AS r(row_ctid, clients)
     WHERE i.ctid = r.row_ctid AND r.clients = '{}';
END
$$;
COMMENT ON FUNCTION pgbroker._interest_shrink(integer[], jsonb[], text[], bigint[], text[]) IS
    'Internal: strike client_ids[i] from the interest row of (watch_ids[i], row_keys[i], names[i], epochs[i]); rows left empty are deleted. A probe per row, locked in key order.';

-- Before subscribing to a table: its triggers must be in place (a
-- subscription to a table whose triggers are gone or disabled would never
-- hear of a change: triggers dropped by hand, or a dropped watched table
-- whose oid a new table reused), then the watch lock, exclusive against
-- writers' triggers (a shared try-lock of their gate, held to commit): every
-- gate, in order, then the key itself (300_watched_tables.sql), so writers
-- that already read the interest without us commit first; later ones either
-- see us or, finding their gate taken, leave their subscribers to be
-- resolved at fetch time.  They never queue behind this request.  Held to
-- commit; WAIT bounds the whole.
CREATE FUNCTION pgbroker._subscribe_lock(p_watch pgbroker.watched, p_table regclass, p_wait interval)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_timeout text := current_setting('lock_timeout');
    v_wait_ms text := pgbroker._wait_ms(p_wait);  -- '0' (NULL): no limit
    v_deadline timestamptz := clock_timestamp() + (v_wait_ms || ' ms')::interval;
    v_key integer;
BEGIN
    IF (SELECT count(*) FROM pg_catalog.pg_trigger t
         WHERE t.tgrelid = p_watch.relid AND t.tgenabled <> 'D'
           AND t.tgname IN ('_pgbroker_watch_ins', '_pgbroker_watch_upd', '_pgbroker_watch_del', '_pgbroker_watch_trunc')) <> 4 THEN
        RAISE EXCEPTION 'the pgbroker triggers of table % are missing or disabled', p_table
            USING ERRCODE = 'PB021', HINT = 'An administrator must call pgbroker.watch() on it again (or ENABLE the triggers).';
    END IF;
    BEGIN
        FOR v_key IN SELECT pgbroker._lock_gate_key(p_watch.watch_id, g) FROM generate_series(0, pgbroker._lock_gates() - 1) g
                     UNION ALL SELECT p_watch.watch_id LOOP
            IF NOT pg_try_advisory_xact_lock(pgbroker._lock_class_watch(), v_key) THEN
                -- What is left of WAIT, at least 1 ms (a lock_timeout of 0 is no limit).
                PERFORM set_config('lock_timeout',
                                   CASE WHEN v_wait_ms = '0' THEN '0'
                                        ELSE greatest(1, ceil(extract(epoch FROM v_deadline - clock_timestamp()) * 1000))::bigint::text END,
                                   true);
                PERFORM pg_advisory_xact_lock(pgbroker._lock_class_watch(), v_key);
                PERFORM set_config('lock_timeout', v_timeout, true);
            END IF;
        END LOOP;
    EXCEPTION WHEN lock_not_available THEN
        RAISE EXCEPTION 'table % is busy: a writer transaction stayed open longer than %', p_watch.table_name, p_wait
            USING ERRCODE = 'PB022', HINT = 'Retry, or pass a longer wait.';
    END;
END
$$;
COMMENT ON FUNCTION pgbroker._subscribe_lock(pgbroker.watched, regclass, interval) IS
    'Internal: check a watched table''s triggers (PB021), then take every gate of its watch lock exclusively to commit, waiting at most p_wait in all for writers (PB022).';

CREATE FUNCTION pgbroker.subscribe(client_id text, "table" regclass, key jsonb DEFAULT NULL,
                                   name text DEFAULT 'default', epoch bigint DEFAULT NULL,
                                   wait interval DEFAULT '5 s', filter jsonb DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(subscribe.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, subscribe.epoch);
    v_client bigint := pgbroker._client_key(v_name, v_epoch, subscribe.client_id);
    v_watch pgbroker.watched := pgbroker._watch_of(subscribe."table");
    v_key jsonb;
BEGIN
    IF subscribe.filter IS NOT NULL THEN
        IF subscribe.key IS NOT NULL THEN
            RAISE EXCEPTION 'give a key or a filter, not both' USING ERRCODE = 'invalid_parameter_value';
        END IF;
        RETURN pgbroker._subscribe_filters(v_name, v_epoch, ARRAY[subscribe.client_id], v_watch, ARRAY[subscribe.filter],
                                           subscribe.wait, false) > 0;
    END IF;
    v_key := pgbroker._encode_key(v_watch, subscribe.key);
    PERFORM pgbroker._subscribe_lock(v_watch, subscribe."table", subscribe.wait);
    INSERT INTO pgbroker.subscription (client_key, watch_id, row_key)
    VALUES (v_client, v_watch.watch_id, v_key)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO pgbroker.interest AS i (watch_id, row_key, name, epoch, lock_key, clients)
    VALUES (v_watch.watch_id, v_key, v_name, v_epoch, (SELECT l.lock_key FROM pgbroker.lease l WHERE l.name = v_name),
            ARRAY[subscribe.client_id])
    ON CONFLICT ON CONSTRAINT interest_pkey DO UPDATE SET clients = i.clients || subscribe.client_id;
    IF pgbroker._registry_watched(v_name) THEN
        PERFORM pg_notify('pgbroker_registry_' || md5(v_name),
                          pgbroker._registry_subscription_event('subscribe', v_name, v_epoch, subscribe.client_id,
                                                                v_watch.relid::regclass::text, v_key));
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION pgbroker.subscribe(text, regclass, jsonb, text, bigint, interval, jsonb) IS
$$Holder only: subscribe client CLIENT_ID to the row of watched TABLE whose primary key is KEY (jsonb: a scalar for a
one-column key, an array in key order for a composite one), or to the whole table when KEY and FILTER are NULL, or to
the rows matching FILTER (a JSON object of column values: {"team": 7}, {"status": {"in": ["open", "pending"]}},
{"closed_at": null}; several columns must all match; sql/README.md, "Filters"), whose clients are also told when a row
leaves it (outbox_fetch's left).
No gap: once it returns, every change that commits later is in the outbox, so a client that subscribes and then reads
the row (or the filter's rows) misses nothing. Waits up to WAIT for writer transactions already past their trigger
(PB022 after that); writers never wait for it. Returns false when the subscription existed (a filter: each of its points).
PB010 unknown client, PB021 table not watched, 22023 bad key; a bad filter: 22023, 42703, PB023, 54000, 22P02 (sql/README.md, "Filters").$$;

-- Subscribe CLIENT_IDS[i] to the (encoded) key or point KEYS[i], for every i, in one statement; POSITIONS[i] (NULL:
-- i) is where the pair came from in the caller's arrays, for the error of an unknown client.
CREATE FUNCTION pgbroker._subscribe_pairs(p_name text, p_epoch bigint, p_client_ids text[], p_watch pgbroker.watched,
                                          p_keys jsonb[], p_wait interval, p_positions integer[])
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
-- Planned for each call's arrays: a generic plan, made for no size in particular, joined them in loops.
SET plan_cache_mode = force_custom_plan
-- Hash joins of the arrays: a merge join sorted both (the estimates made it look cheaper).
SET enable_mergejoin = off
-- No JIT: the arrays' estimates put a batch over jit_above_cost, and compiling cost a batch of 10,000 ~20 ms (10%),
-- more than it could save.
SET jit = off
AS $$
DECLARE
    v_ids text[];
    v_client_keys bigint[];
    v_fresh boolean[];
    v_bad integer;
    v_new bigint;
    v_watched boolean;
    v_announced bigint;
BEGIN
    -- Each client given, looked up and its row locked (as subscribe() locks
    -- it) once, by an index probe: a batch costs the same whatever the
    -- number of the epoch's clients.  Or the error subscribe() gives for the
    -- first unknown one, naming its position.  A client with no subscription
    -- to the table yet (every client, after a restart) is "fresh": none of
    -- its pairs needs looking for below.  That takes a probe per client,
    -- which saves one per pair: asked only of clients given several pairs
    -- (a batch of 10,000 filters of 10,000 clients spent 17 ms on it).
    WITH ids AS (
        SELECT u.id, min(coalesce(u.pos, u.i)) AS i, count(*) AS pairs
          FROM unnest(p_client_ids, p_positions) WITH ORDINALITY AS u(id, pos, i) GROUP BY u.id
    )
    SELECT min(ids.i) FILTER (WHERE c.client_key IS NULL), array_agg(ids.id), array_agg(c.client_key),
           array_agg(ids.pairs > 1 AND NOT EXISTS (SELECT FROM pgbroker.subscription s
                                                    WHERE s.client_key = c.client_key AND s.watch_id = p_watch.watch_id))
      INTO v_bad, v_ids, v_client_keys, v_fresh
      FROM ids
      LEFT JOIN LATERAL (SELECT x.client_key FROM pgbroker.client x
                          WHERE x.name = p_name AND x.epoch = p_epoch AND x.client_id = ids.id
                            FOR KEY SHARE) c ON true;
    IF v_bad IS NOT NULL THEN
        RAISE EXCEPTION 'client "%" (client_ids[%]) is not registered with broker "%"',
                (SELECT u.id FROM unnest(p_client_ids, p_positions) WITH ORDINALITY AS u(id, pos, i)
                  WHERE coalesce(u.pos, u.i) = v_bad LIMIT 1), v_bad, p_name
            USING ERRCODE = 'PB010', HINT = 'Register it first with pgbroker.client_register() or client_register_many().';
    END IF;
    PERFORM pgbroker._subscribe_lock(p_watch, p_watch.relid::regclass, p_wait);
    v_watched := pgbroker._registry_watched(p_name);
    -- One statement, one round of the watch lock, whatever the number: the
    -- pairs not subscribed yet (a pair given twice counts once), inserted,
    -- and their ids appended to the interest of their key.  No ON CONFLICT: subscriptions to a table are only made under
    -- its watch lock, which this transaction holds exclusively, so no other
    -- can insert one of these pairs meanwhile.  (Arrays are read with unnest,
    -- never subscripted: subscripting an array of variable-length values
    -- costs time in proportion to the position.)
    WITH clients AS (
        SELECT k.id, k.client_key, k.fresh FROM unnest(v_ids, v_client_keys, v_fresh) AS k(id, client_key, fresh)
    ), new AS MATERIALIZED (
        SELECT c.client_key, g.id, g.row_key
          FROM (SELECT DISTINCT u.id, u.row_key FROM unnest(p_client_ids, p_keys) AS u(id, row_key)) g
          JOIN clients c ON c.id = g.id
          -- an index probe per pair of a client that is not fresh, never a scan of what the table has
          LEFT JOIN LATERAL (SELECT true AS found FROM pgbroker.subscription s
                              WHERE NOT c.fresh
                                AND s.client_key = c.client_key AND s.watch_id = p_watch.watch_id AND s.row_key = g.row_key
                              LIMIT 1) e ON true
         WHERE e.found IS NULL
    ), added AS (
        INSERT INTO pgbroker.subscription (client_key, watch_id, row_key)
        SELECT n.client_key, p_watch.watch_id, n.row_key FROM new n
    ), interest AS (
        INSERT INTO pgbroker.interest AS i (watch_id, row_key, name, epoch, lock_key, clients, range_box)
        SELECT p_watch.watch_id, n.row_key, p_name, p_epoch, (SELECT l.lock_key FROM pgbroker.lease l WHERE l.name = p_name),
               array_agg(n.id), pgbroker._range_box(p_watch.watch_id, n.row_key)
          FROM new n
         GROUP BY n.row_key
        ON CONFLICT ON CONSTRAINT interest_pkey DO UPDATE SET clients = i.clients || excluded.clients
    )
    -- (A FILTER is tested before its aggregate's argument: nothing is
    -- announced while nobody watches.)
    SELECT count(*),
           sum(num_nulls(pg_notify('pgbroker_registry_' || md5(p_name),
                                   pgbroker._registry_subscription_event('subscribe', p_name, p_epoch, n.id,
                                                                         p_watch.relid::regclass::text, n.row_key))))
               FILTER (WHERE v_watched)
      INTO v_new, v_announced
      FROM new n;
    RETURN v_new;
END
$$;
COMMENT ON FUNCTION pgbroker._subscribe_pairs(text, bigint, text[], pgbroker.watched, jsonb[], interval, integer[]) IS
    'Internal: subscribe client_ids[i] to the encoded key (or filter point) keys[i] of a watched table, for every i, in one statement under the table''s watch lock; returns how many were new.';

CREATE FUNCTION pgbroker.subscribe_many(client_ids text[], "table" regclass, keys jsonb[], name text DEFAULT 'default',
                                        epoch bigint DEFAULT NULL, wait interval DEFAULT '5 s')
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(subscribe_many.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, subscribe_many.epoch);
    v_n integer := pgbroker._check_arrays('client_ids', array_ndims(subscribe_many.client_ids),
                                          cardinality(subscribe_many.client_ids), 'keys', array_ndims(subscribe_many.keys),
                                          cardinality(subscribe_many.keys), false);
    v_watch pgbroker.watched := pgbroker._watch_of(subscribe_many."table");
BEGIN
    RETURN pgbroker._subscribe_pairs(v_name, v_epoch, subscribe_many.client_ids, v_watch,
                                     pgbroker._encode_keys(v_watch, subscribe_many.keys), subscribe_many.wait, NULL);
END
$$;
COMMENT ON FUNCTION pgbroker.subscribe_many(text[], regclass, jsonb[], text, bigint, interval) IS
$$Holder only: subscribe client CLIENT_IDS[i] to the row of watched TABLE whose key is KEYS[i] (NULL: the whole table), for every i, in one statement; returns how many subscriptions were new.
As subscribe() otherwise, with one wait for the table's writers per call: no gap; PB010 for an unknown client, 22023 (or the cast's own SQLSTATE) for a bad key, each naming its position (client_ids[3], keys[3]); 22004 / 22023 for NULL arrays or arrays of different lengths; PB021, PB022 as subscribe(). Nothing of the call is kept when it fails.$$;

-- Subscribe client_ids[i] to filters[i] (every point of it), for every i: the filters expanded, their new shapes
-- recorded (the table's triggers rendered again), then the pairs subscribed in one statement.
CREATE FUNCTION pgbroker._subscribe_filters(p_name text, p_epoch bigint, p_client_ids text[], p_watch pgbroker.watched,
                                            p_filters jsonb[], p_wait interval, p_bulk boolean)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_ids text[];
    v_points jsonb[];
    v_positions integer[];
    v_shapes jsonb[];
BEGIN
    PERFORM pgbroker._wait_ms(p_wait);  -- 22023 on a negative wait, before anything
    SELECT p.positions, p.points, p.shapes INTO v_positions, v_points, v_shapes
      FROM pgbroker._filter_points(p_watch, p_filters, p_bulk) AS p;
    IF cardinality(v_points) = cardinality(p_filters) THEN
        v_ids := p_client_ids;  -- one point per filter (a filter has at least one), in order
    ELSE
        v_ids := ARRAY(SELECT c.id FROM unnest(v_positions) WITH ORDINALITY AS p(pos, n)
                         JOIN unnest(p_client_ids) WITH ORDINALITY AS c(id, i) ON c.i = p.pos
                        ORDER BY p.n);
    END IF;
    PERFORM pgbroker._filter_shapes_add(p_watch, v_shapes, p_wait);
    RETURN pgbroker._subscribe_pairs(p_name, p_epoch, v_ids, p_watch, v_points, p_wait, v_positions);
END
$$;
COMMENT ON FUNCTION pgbroker._subscribe_filters(text, bigint, text[], pgbroker.watched, jsonb[], interval, boolean) IS
    'Internal: subscribe client_ids[i] to every point of filters[i] of a watched table; returns how many subscriptions were new.';

CREATE FUNCTION pgbroker.subscribe_filters(client_ids text[], "table" regclass, filters jsonb[],
                                           name text DEFAULT 'default', epoch bigint DEFAULT NULL,
                                           wait interval DEFAULT '5 s')
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(subscribe_filters.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, subscribe_filters.epoch);
    v_n integer := pgbroker._check_arrays('client_ids', array_ndims(subscribe_filters.client_ids),
                                          cardinality(subscribe_filters.client_ids), 'filters',
                                          array_ndims(subscribe_filters.filters), cardinality(subscribe_filters.filters),
                                          false);
    v_watch pgbroker.watched := pgbroker._watch_of(subscribe_filters."table");
BEGIN
    IF v_n = 0 THEN
        RETURN 0;
    END IF;
    RETURN pgbroker._subscribe_filters(v_name, v_epoch, subscribe_filters.client_ids, v_watch, subscribe_filters.filters,
                                       subscribe_filters.wait, true);
END
$$;
COMMENT ON FUNCTION pgbroker.subscribe_filters(text[], regclass, jsonb[], text, bigint, interval) IS
$$Holder only: subscribe client CLIENT_IDS[i] to the rows of watched TABLE matching FILTERS[i] (as subscribe()'s
FILTER), for every i, in one statement; returns how many subscriptions (points of filters) were new.
As subscribe_many() otherwise: no gap, one wait for the table's writers per call, errors naming their position
(client_ids[3], filters[3]): PB010, 22023, 42703, PB023, 54000, 22P02; nothing of the call is kept when it fails.$$;

CREATE FUNCTION pgbroker.unsubscribe(client_id text, "table" regclass, key jsonb DEFAULT NULL,
                                     name text DEFAULT 'default', epoch bigint DEFAULT NULL, filter jsonb DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(unsubscribe.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, unsubscribe.epoch);
    v_client bigint := pgbroker._client_key(v_name, v_epoch, unsubscribe.client_id);
    v_watch pgbroker.watched := pgbroker._watch_of(unsubscribe."table");
    v_keys jsonb[];
    v_n integer;
BEGIN
    IF unsubscribe.filter IS NULL THEN
        v_keys := ARRAY[pgbroker._encode_key(v_watch, unsubscribe.key)];
    ELSIF unsubscribe.key IS NOT NULL THEN
        RAISE EXCEPTION 'give a key or a filter, not both' USING ERRCODE = 'invalid_parameter_value';
    ELSE
        SELECT p.points INTO v_keys FROM pgbroker._filter_points(v_watch, ARRAY[unsubscribe.filter], false) AS p;
    END IF;
    WITH gone AS (
        DELETE FROM pgbroker.subscription s
         WHERE s.client_key = v_client AND s.watch_id = v_watch.watch_id AND s.row_key = ANY (v_keys)
        RETURNING s.row_key
    )
    SELECT array_agg(g.row_key) INTO v_keys FROM gone g;
    v_n := cardinality(v_keys);
    IF v_n IS NULL THEN
        RETURN false;
    END IF;
    PERFORM pgbroker._interest_shrink(array_fill(v_watch.watch_id, ARRAY[v_n]), v_keys, array_fill(v_name, ARRAY[v_n]),
                                      array_fill(v_epoch, ARRAY[v_n]), array_fill(unsubscribe.client_id, ARRAY[v_n]));
    IF pgbroker._registry_watched(v_name) THEN
        PERFORM pg_notify('pgbroker_registry_' || md5(v_name),
                          pgbroker._registry_subscription_event('unsubscribe', v_name, v_epoch, unsubscribe.client_id,
                                                                v_watch.relid::regclass::text, k))
           FROM unnest(v_keys) AS k;
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION pgbroker.unsubscribe(text, regclass, jsonb, text, bigint, jsonb) IS
    'Holder only: drop the subscription of CLIENT_ID to KEY of TABLE (KEY and FILTER NULL: the whole-table one), or to every point of FILTER (as in subscribe()); false when there was none.';

-- ---------------------------------------------------------------------------
-- Keeping the interest in step with the client registry.

-- A deleted client's subscriptions go with it; one of the current epoch
-- (unregistered) also leaves the interest it made.  (The clients of earlier
-- epochs are deleted by broker_sweep() after their subscriptions, and their
-- interest is deleted whole.)  Once per statement, with the deleted rows in
-- hand: client_unregister_many() deletes ten thousand clients in one.  The
-- subscriptions are found by the primary key's first column, each interest
-- row by its whole key (_interest_shrink): no table here is joined on what
-- its statistics say.
CREATE FUNCTION pgbroker._interest_drop_clients()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_watch_ids integer[];
    v_row_keys jsonb[];
    v_names text[];
    v_epochs bigint[];
    v_client_ids text[];
BEGIN
    WITH gone AS (
        SELECT o.client_key, o.client_id, o.name, o.epoch,
               o.epoch = (SELECT l.epoch FROM pgbroker.lease l WHERE l.name = o.name) AS current
          FROM old_clients o
    ), subs AS (
        DELETE FROM pgbroker.subscription s WHERE s.client_key = ANY (ARRAY(SELECT g.client_key FROM gone g))
        RETURNING s.client_key, s.watch_id, s.row_key
    )
    SELECT array_agg(s.watch_id), array_agg(s.row_key), array_agg(g.name), array_agg(g.epoch), array_agg(g.client_id)
      INTO v_watch_ids, v_row_keys, v_names, v_epochs, v_client_ids
      FROM subs s JOIN gone g ON g.client_key = s.client_key
     WHERE g.current;
    IF v_watch_ids IS NOT NULL THEN
        PERFORM pgbroker._interest_shrink(v_watch_ids, v_row_keys, v_names, v_epochs, v_client_ids);
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._interest_drop_clients() IS
    'Internal (statement trigger): delete the deleted clients'' subscriptions; those of the current epoch also leave pgbroker.interest.';

CREATE TRIGGER _400_drop_interest
AFTER DELETE ON pgbroker.client
REFERENCING OLD TABLE AS old_clients
FOR EACH STATEMENT EXECUTE FUNCTION pgbroker._interest_drop_clients();
COMMENT ON TRIGGER _400_drop_interest ON pgbroker.client IS 'A deleted client''s subscriptions go with it, and an unregistered one leaves the interest they made.';
