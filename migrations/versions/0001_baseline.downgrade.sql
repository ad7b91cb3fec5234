-- Generated from sql/ by migrations/build_baseline.py: do not edit.
-- Remove everything pgbroker_0001_baseline created, and nothing else.
SELECT pgbroker.unwatch(relid::regclass) FROM pgbroker.watched WHERE to_regclass(relid::regclass::text) IS NOT NULL;
DELETE FROM pgbroker.watched;
SELECT pgbroker._set_database_search_path(false);

DROP VIEW pgbroker.metrics;
DROP VIEW pgbroker.health;
DROP VIEW pgbroker.broker_overview;
DROP VIEW pgbroker.counters;
DROP VIEW pgbroker.kv;
DROP VIEW pgbroker.semaphores;
DROP VIEW pgbroker.locks;
DROP VIEW pgbroker.sweep_backlog;
DROP VIEW pgbroker.clients;
DROP VIEW pgbroker.outbox_pending;
DROP VIEW pgbroker.subscriptions;
DROP VIEW pgbroker.watched_tables;
DROP VIEW pgbroker.broker_state;
DROP VIEW pgbroker.lease_history;
DROP VIEW pgbroker.brokers;
DROP FUNCTION pgbroker.counter_set(text, bigint, bigint);
DROP FUNCTION pgbroker.counter_get(text);
DROP FUNCTION pgbroker.counter_add(text, bigint);
DROP TABLE pgbroker.counter;
DROP FUNCTION pgbroker.kv_delete(text, bigint);
DROP FUNCTION pgbroker.kv_set(text, jsonb, bigint, interval);
DROP FUNCTION pgbroker.kv_get(text);
DROP FUNCTION pgbroker.kv_watch_end();
DROP FUNCTION pgbroker.kv_watch_begin();
DROP FUNCTION pgbroker._kv_announce(text, bigint, boolean);
DROP FUNCTION pgbroker.kv_channel();
DROP SEQUENCE pgbroker.kv_version_seq;
DROP TABLE pgbroker.kv_entry;
DROP FUNCTION pgbroker._lock_class_kv();
DROP FUNCTION pgbroker.semaphore_release(text);
DROP FUNCTION pgbroker.semaphore_acquire(text, integer, interval);
DROP FUNCTION pgbroker.semaphore_channel(text);
DROP FUNCTION pgbroker._semaphore_keys(text, integer, interval);
DROP FUNCTION pgbroker._semaphore_try(integer[], boolean[]);
DROP TRIGGER _660_permit_at_commit ON pgbroker.semaphore_permit;
DROP FUNCTION pgbroker._semaphore_permit_commit();
DROP TABLE pgbroker.semaphore_permit;
DROP FUNCTION pgbroker._lock_class_permit();
DROP FUNCTION pgbroker.lock_key(text);
DROP FUNCTION pgbroker.lock_release(text, boolean);
DROP FUNCTION pgbroker.lock_acquire(text, interval, boolean, boolean);
DROP FUNCTION pgbroker._lock_key(text, interval);
DROP FUNCTION pgbroker._check_key(text, text);
DROP TRIGGER _650_lock_at_commit ON pgbroker.lock_name;
DROP FUNCTION pgbroker._lock_name_commit();
DROP TABLE pgbroker.lock_name;
DROP FUNCTION pgbroker._lock_class_lock();
DROP FUNCTION pgbroker.unwatch(regclass, interval);
DROP FUNCTION pgbroker.watch(regclass, interval, text);
DROP FUNCTION pgbroker._watch_drop_triggers(pgbroker.watched);
DROP FUNCTION pgbroker._watch_install(pgbroker.watched, interval);
DROP FUNCTION pgbroker._watch_function_body(pgbroker.watched, text);
DROP FUNCTION pgbroker._watch_slots(pgbroker.watched);
DROP FUNCTION pgbroker._watch_exprs(pgbroker.watched, text, text);
DROP FUNCTION pgbroker._watch_lock_table(regclass, interval);
DROP FUNCTION pgbroker._render(text, jsonb);
DROP FUNCTION pgbroker._watch_truncate_template();
DROP FUNCTION pgbroker._watch_row_change_template(text, text);
DROP FUNCTION pgbroker._watch_row_trigger_template();
DROP FUNCTION pgbroker._watch_trigger_template();
DROP FUNCTION pgbroker._watch_alive_template();
DROP FUNCTION pgbroker._watch_unresolved_template();
DROP FUNCTION pgbroker._watch_merged_template();
DROP FUNCTION pgbroker._watch_bulk_template();
DROP FUNCTION pgbroker._watch_fanout_template();
DROP FUNCTION pgbroker.broker_sweep(text, integer);
DROP TRIGGER _500_forget_client ON pgbroker.client;
DROP FUNCTION pgbroker._outbox_forget_client();
DROP FUNCTION pgbroker.outbox_ack(text, bigint[]);
DROP FUNCTION pgbroker.outbox_fetch(text, integer, bigint[]);
DROP FUNCTION pgbroker._outbox_resolve(text, bigint);
DROP FUNCTION pgbroker._outbox_floor(text, bigint, boolean);
DROP FUNCTION pgbroker.broker_sleep(text, interval);
DROP FUNCTION pgbroker.broker_wake(text);
DROP FUNCTION pgbroker._awake_held(integer);
DROP FUNCTION pgbroker.wakeup_channel(text);
DROP FUNCTION pgbroker._lock_class_awake();
DROP FUNCTION pgbroker._lock_class_drain();
DROP TABLE pgbroker.outbox;
DROP TRIGGER _400_drop_interest ON pgbroker.client;
DROP FUNCTION pgbroker._interest_drop_client();
DROP FUNCTION pgbroker.unsubscribe(text, regclass, jsonb, text, bigint);
DROP FUNCTION pgbroker.subscribe_many(text[], regclass, jsonb[], text, bigint, interval);
DROP FUNCTION pgbroker.subscribe(text, regclass, jsonb, text, bigint, interval);
DROP FUNCTION pgbroker._subscribe_lock(pgbroker.watched, regclass, interval);
DROP FUNCTION pgbroker._interest_remove(bigint, integer, jsonb);
DROP FUNCTION pgbroker._registry_subscription_event(text, text, bigint, text, text, jsonb);
DROP TABLE pgbroker.interest;
DROP TABLE pgbroker.subscription;
DROP FUNCTION pgbroker._encode_keys(pgbroker.watched, jsonb[]);
DROP FUNCTION pgbroker._encode_key_at(pgbroker.watched, jsonb, integer);
DROP FUNCTION pgbroker._encode_key(pgbroker.watched, jsonb);
DROP FUNCTION pgbroker._key_shape_ok(integer, jsonb);
DROP FUNCTION pgbroker._key_expression(pgbroker.watched, text);
DROP FUNCTION pgbroker._key_settings(regtype[]);
DROP FUNCTION pgbroker._watch_of(regclass);
DROP FUNCTION pgbroker._lock_class_watch();
DROP TABLE pgbroker.watched;
DROP FUNCTION pgbroker.client_unregister(text, text, bigint);
DROP FUNCTION pgbroker.client_update(text, jsonb, text, bigint);
DROP FUNCTION pgbroker.client_register_many(text[], jsonb[], text, bigint);
DROP FUNCTION pgbroker.client_register(text, jsonb, text, bigint);
DROP FUNCTION pgbroker._check_arrays(text, integer, integer, text, integer, integer, boolean);
DROP FUNCTION pgbroker._check_client_id(text, text);
DROP FUNCTION pgbroker._client_key(text, bigint, text);
DROP FUNCTION pgbroker._acting_epoch(text, bigint);
DROP FUNCTION pgbroker._registry_client_event(text, text, bigint, text, jsonb);
DROP FUNCTION pgbroker._registry_watched(text);
DROP FUNCTION pgbroker.registry_watch_end(text);
DROP FUNCTION pgbroker.registry_watch_begin(text);
DROP FUNCTION pgbroker.registry_channel(text);
DROP FUNCTION pgbroker._registry_key(text);
DROP FUNCTION pgbroker._lock_class_registry_write();
DROP FUNCTION pgbroker._lock_class_registry();
DROP TABLE pgbroker.client;
DROP FUNCTION pgbroker.lease_history_prune(interval);
DROP FUNCTION pgbroker.broker_state_delete(text, text);
DROP FUNCTION pgbroker.broker_state_set(text, text, jsonb);
DROP FUNCTION pgbroker._holder_epoch(text);
DROP FUNCTION pgbroker.broker_alive(text);
DROP FUNCTION pgbroker.lease_expiry_check(text);
DROP FUNCTION pgbroker.broker_assert(text, bigint);
DROP FUNCTION pgbroker.broker_heartbeat(text);
DROP FUNCTION pgbroker.broker_renew(text, text, interval);
DROP FUNCTION pgbroker.broker_release(text, text);
DROP FUNCTION pgbroker.broker_claim(text, interval, boolean, interval, text, text, interval);
DROP FUNCTION pgbroker._lease_claim(text, interval, integer, interval, text, text, interval, boolean);
DROP FUNCTION pgbroker._lease_takeover_stale(text, interval);
DROP FUNCTION pgbroker._lease_takeover(text);
DROP FUNCTION pgbroker._lease_terminate(text, integer);
DROP FUNCTION pgbroker._lease_expire(text);
DROP FUNCTION pgbroker._lease_sweep();
DROP TRIGGER _900_sync_session_lock ON pgbroker.lease;
DROP FUNCTION pgbroker._lease_sync_session_lock();
DROP FUNCTION pgbroker._lease_touch(pgbroker.lease);
DROP FUNCTION pgbroker._wait_ms(interval);
DROP FUNCTION pgbroker._raise_held(text);
DROP FUNCTION pgbroker._lock_holder_pid(integer);
DROP FUNCTION pgbroker._lease_live(pgbroker.lease);
DROP FUNCTION pgbroker._lease_alive(integer, timestamptz, integer);
DROP FUNCTION pgbroker._check_name(text);
DROP TABLE pgbroker.state;
DROP TRIGGER _100_announce ON pgbroker.lease_event;
DROP FUNCTION pgbroker._lease_event_announce();
DROP FUNCTION pgbroker.lease_channel();
DROP TABLE pgbroker.lease_event;
DROP FUNCTION pgbroker._next_epoch();
DROP SEQUENCE pgbroker.lease_epoch_seq;
DROP TABLE pgbroker.lease;
DROP FUNCTION pgbroker._my_backend_start();
DROP FUNCTION pgbroker._epoch_key(bigint);
DROP FUNCTION pgbroker._lock_class_alive();
DROP FUNCTION pgbroker._lock_class();
DROP FUNCTION pgbroker.schema_version();

REVOKE ALL ON SCHEMA pgbroker FROM PUBLIC, pgbroker_broker, pgbroker_reader, pgbroker_user, pgbroker_admin;
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

-- Outside pgbroker's own alembic environment (whose env.py drops the schema
-- after removing its version table) the schema goes here.
DO $schema$
BEGIN
    IF to_regclass('pgbroker.alembic_version') IS NULL THEN
        DROP SCHEMA pgbroker;
    END IF;
END
$schema$;
