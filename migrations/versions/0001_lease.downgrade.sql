-- Remove everything 0001_lease created, and nothing else.
SELECT pgbroker._set_database_search_path(false);

DROP VIEW pgbroker.broker_state, pgbroker.lease_history, pgbroker.brokers;
DROP FUNCTION
    pgbroker.lease_history_prune(interval),
    pgbroker.broker_state_delete(text, text),
    pgbroker.broker_state_set(text, text, jsonb),
    pgbroker._holder_epoch(text),
    pgbroker.broker_assert(text, bigint),
    pgbroker.broker_heartbeat(text),
    pgbroker.broker_release(text),
    pgbroker.broker_claim(text, interval, boolean, interval, text),
    pgbroker._lease_claim(text, interval, integer, interval, text),
    pgbroker._lease_takeover_stale(text, interval),
    pgbroker._lease_takeover(text),
    pgbroker._lease_terminate(text, integer),
    pgbroker._lease_clear_state(text, bigint),
    pgbroker._lease_sweep();
DROP TRIGGER _900_sync_session_lock ON pgbroker.lease;
DROP FUNCTION
    pgbroker._lease_sync_session_lock(),
    pgbroker._lease_touch(pgbroker.lease),
    pgbroker._wait_ms(interval),
    pgbroker._raise_held(text),
    pgbroker._lock_holder_pid(integer),
    pgbroker._lease_alive(integer, timestamptz, integer),
    pgbroker._check_name(text);
DROP TABLE pgbroker.state, pgbroker.lease_event, pgbroker.lease;
DROP SEQUENCE pgbroker.lease_epoch_seq;
DROP FUNCTION pgbroker._my_backend_start(), pgbroker._lock_class();

-- Roles this installation created: revoke what they hold here and drop them.
-- A role still used in another database of the cluster is kept.
REVOKE ALL ON SCHEMA pgbroker FROM pgbroker_broker, pgbroker_reader, pgbroker_admin;
DO $roles$
DECLARE
    v_role name;
BEGIN
    FOR v_role IN SELECT object FROM pgbroker.installed WHERE kind = 'role' ORDER BY object LOOP
        BEGIN
            EXECUTE format('DROP ROLE %I', v_role);
        EXCEPTION WHEN dependent_objects_still_exist THEN
            RAISE NOTICE 'role % kept: it still has privileges in another database', v_role;
        END;
    END LOOP;
END
$roles$;
DROP TABLE pgbroker.installed;
DROP FUNCTION pgbroker._set_database_search_path(boolean), pgbroker._search_path_elements(text);

-- Outside pgbroker's own alembic environment (which drops the schema after
-- removing its version table) the schema goes here.
DO $schema$
BEGIN
    IF to_regclass('pgbroker.alembic_version') IS NULL THEN
        DROP SCHEMA pgbroker;
    END IF;
END
$schema$;
