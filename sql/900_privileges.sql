-- pgbroker: who may do what, in one place.
--
-- PUBLIC gets USAGE on the schema and nothing else but schema_version(), so
-- that a role without pgbroker rights that calls a function is told it lacks
-- the right to, rather than that the function does not exist.  Four NOLOGIN
-- roles (created in 000_schema.sql) are granted to the user's login roles:
--   pgbroker_reader  SELECT on the views, broker_alive()
--   pgbroker_broker  the lease, broker state, clients, subscriptions, delivery
--   pgbroker_user    the coordination primitives: locks, semaphores, the
--                    key-value store, counters, rate limits (workers that use
--                    them need no power over the lease, such as stale takeovers)
--   pgbroker_admin   all three, plus takeover => true, watch, unwatch, pruning
-- Tables and internal (_-prefixed) functions are never granted: the API
-- functions (SECURITY DEFINER, search_path pinned) and the views are the
-- interface.  A test compares what each role may execute with the role table
-- of sql/README.md.

-- Functions are created with EXECUTE for PUBLIC: take it all back first.
-- (ALTER DEFAULT PRIVILEGES IN SCHEMA cannot take away the global default.)
REVOKE ALL ON SCHEMA pgbroker FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA pgbroker FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA pgbroker FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pgbroker FROM PUBLIC;

GRANT USAGE ON SCHEMA pgbroker TO PUBLIC;
GRANT EXECUTE ON FUNCTION pgbroker.schema_version() TO PUBLIC;

-- pgbroker_admin is a member of the other three.  Since PostgreSQL 16 that
-- needs ADMIN OPTION on them, which an installer with CREATEROLE has on the
-- roles it created, not on roles a superuser created beforehand: then
-- pgbroker_admin gets their privileges directly (at the end of this file).
DO $admin$
DECLARE
    v_role text;
BEGIN
    FOREACH v_role IN ARRAY ARRAY['pgbroker_broker', 'pgbroker_reader', 'pgbroker_user'] LOOP
        IF NOT pg_catalog.pg_has_role('pgbroker_admin', v_role, 'MEMBER') THEN
            BEGIN
                EXECUTE format('GRANT %I TO pgbroker_admin', v_role);
            EXCEPTION WHEN insufficient_privilege THEN
                RAISE NOTICE 'pgbroker: pgbroker_admin is not made a member of %, role % has no ADMIN OPTION on it; it gets its privileges directly',
                        v_role, current_user
                    USING HINT = format('To have the membership, as a superuser: GRANT %I TO pgbroker_admin;', v_role);
            END;
        END IF;
    END LOOP;
END
$admin$;

-- Readers: the views.
GRANT SELECT ON
    pgbroker.brokers,
    pgbroker.lease_history,
    pgbroker.broker_state,
    pgbroker.clients,
    pgbroker.subscriptions,
    pgbroker.watched_tables,
    pgbroker.outbox_pending,
    pgbroker.locks,
    pgbroker.semaphores,
    pgbroker.kv,
    pgbroker.counters,
    pgbroker.rate_limits,
    pgbroker.sweep_backlog,
    pgbroker.name_grants,
    pgbroker.name_grants_version,
    pgbroker.unaccounted_locks,
    pgbroker.broker_overview,
    pgbroker.health,
    pgbroker.metrics,
    pgbroker.upkeep
TO pgbroker_reader;
GRANT EXECUTE ON FUNCTION
    pgbroker.broker_alive(text),
    pgbroker.lease_channel(),
    pgbroker.lease_expiry_check(text),
    pgbroker.registry_channel(text),
    pgbroker.registry_watch_begin(text),
    pgbroker.registry_watch_end(text),
    pgbroker.name_allowed(text, text, text, regrole),
    pgbroker.lock_audit()
TO pgbroker_reader;

-- Brokers: the lease, broker state, clients, subscriptions and delivery.
GRANT EXECUTE ON FUNCTION
    pgbroker.broker_claim(text, interval, boolean, interval, text, text, interval),
    pgbroker.broker_release(text, text),
    pgbroker.broker_renew(text, text, interval),
    pgbroker.broker_heartbeat(text),
    pgbroker.broker_assert(text, bigint),
    pgbroker.broker_alive(text),
    pgbroker.lease_channel(),
    pgbroker.lease_expiry_check(text),
    pgbroker.broker_state_set(text, text, jsonb),
    pgbroker.broker_state_delete(text, text),
    pgbroker.client_register(text, jsonb, text, bigint),
    pgbroker.client_register_many(text[], jsonb[], text, bigint),
    pgbroker.client_update(text, jsonb, text, bigint),
    pgbroker.client_unregister(text, text, bigint),
    pgbroker.client_unregister_many(text[], text, bigint),
    pgbroker.subscribe(text, regclass, jsonb, text, bigint, interval, jsonb),
    pgbroker.subscribe_many(text[], regclass, jsonb[], text, bigint, interval),
    pgbroker.subscribe_filters(text[], regclass, jsonb[], text, bigint, interval),
    pgbroker.unsubscribe(text, regclass, jsonb, text, bigint, jsonb),
    pgbroker.outbox_fetch(text, integer, bigint[]),
    pgbroker.outbox_ack(text, bigint[]),
    pgbroker.broker_wake(text),
    pgbroker.broker_sleep(text, interval),
    pgbroker.wakeup_channel(text),
    pgbroker.broker_sweep(text, integer),
    pgbroker.maintain(integer),
    pgbroker.name_allowed(text, text, text, regrole)
TO pgbroker_broker;

-- Users: the coordination primitives.
GRANT EXECUTE ON FUNCTION
    pgbroker.lock_acquire(text, interval, boolean, boolean),
    pgbroker.lock_release(text, boolean),
    pgbroker.lock_key(text),
    pgbroker.semaphore_acquire(text, integer, interval),
    pgbroker.semaphore_release(text),
    pgbroker.semaphore_channel(text),
    pgbroker.kv_get(text),
    pgbroker.kv_set(text, jsonb, bigint, interval),
    pgbroker.kv_delete(text, bigint),
    pgbroker.kv_channel(),
    pgbroker.kv_watch_begin(),
    pgbroker.kv_watch_end(),
    pgbroker.counter_add(text, bigint),
    pgbroker.counter_get(text),
    pgbroker.counter_set(text, bigint, bigint),
    pgbroker.counter_delete(text, bigint),
    pgbroker.rate_limit(text, integer, interval, integer, integer),
    pgbroker.name_allowed(text, text, text, regrole)
TO pgbroker_user;
-- ... and reads the views of the primitives (a prefix watch lists keys).
GRANT SELECT ON pgbroker.locks, pgbroker.semaphores, pgbroker.kv, pgbroker.counters, pgbroker.rate_limits,
    pgbroker.name_grants_version
TO pgbroker_user;

-- Admins: watching tables and housekeeping (takeover => true is checked by
-- broker_claim itself: the login role must be a member of pgbroker_admin).
GRANT EXECUTE ON FUNCTION
    pgbroker.watch(regclass, interval, text),
    pgbroker.unwatch(regclass, interval),
    pgbroker.lease_history_prune(interval),
    pgbroker.name_grant(text, text, regrole, text),
    pgbroker.name_revoke(text, text, regrole),
    pgbroker.upkeep_set(interval)
TO pgbroker_admin;

-- pgbroker_admin has every privilege of the three others, whether or not it
-- could be made their member (see above).
DO $admin_direct$
DECLARE
    v_object text;
BEGIN
    FOR v_object IN
        SELECT DISTINCT p.oid::regprocedure::text
          FROM pg_catalog.pg_proc p, aclexplode(p.proacl) a
         WHERE p.pronamespace = 'pgbroker'::regnamespace
           AND a.grantee IN (SELECT r.oid FROM pg_catalog.pg_roles r
                              WHERE r.rolname IN ('pgbroker_broker', 'pgbroker_reader', 'pgbroker_user')
                                AND NOT pg_catalog.pg_has_role('pgbroker_admin', r.oid, 'USAGE'))
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO pgbroker_admin', v_object);
    END LOOP;
    FOR v_object IN
        SELECT DISTINCT c.oid::regclass::text
          FROM pg_catalog.pg_class c, aclexplode(c.relacl) a
         WHERE c.relnamespace = 'pgbroker'::regnamespace AND a.privilege_type = 'SELECT'
           AND a.grantee IN (SELECT r.oid FROM pg_catalog.pg_roles r
                              WHERE r.rolname IN ('pgbroker_broker', 'pgbroker_reader', 'pgbroker_user')
                                AND NOT pg_catalog.pg_has_role('pgbroker_admin', r.oid, 'USAGE'))
    LOOP
        EXECUTE format('GRANT SELECT ON %s TO pgbroker_admin', v_object);
    END LOOP;
END
$admin_direct$;
