-- Undo 0002_fanout: unwatch every table, drop the registry, subscriptions and
-- outbox, and put back the 0001 definition of _lease_clear_state.
SELECT pgbroker.unwatch(relid::regclass) FROM pgbroker.watched WHERE to_regclass(relid::regclass::text) IS NOT NULL;
DELETE FROM pgbroker.watched;

DROP VIEW pgbroker.outbox_pending, pgbroker.subscriptions, pgbroker.watched_tables, pgbroker.clients;
DROP FUNCTION
    pgbroker.outbox_ack(text, bigint[]),
    pgbroker.outbox_fetch(text, integer, bigint[]),
    pgbroker._outbox_floor(text, bigint, boolean),
    pgbroker.unsubscribe(text, regclass, jsonb, text, bigint),
    pgbroker.subscribe(text, regclass, jsonb, text, bigint, interval),
    pgbroker._interest_remove(bigint, integer, jsonb),
    pgbroker.unwatch(regclass),
    pgbroker.watch(regclass),
    pgbroker._watch_drop_triggers(pgbroker.watched),
    pgbroker._watch_install(pgbroker.watched),
    pgbroker.broker_sleep(text, interval),
    pgbroker.broker_wake(text),
    pgbroker._awake_held(integer),
    pgbroker.wakeup_channel(text),
    pgbroker._encode_key(pgbroker.watched, jsonb),
    pgbroker._watch_of(regclass),
    pgbroker._lock_class_awake(),
    pgbroker._lock_class_drain(),
    pgbroker._lock_class_watch(),
    pgbroker.client_unregister(text, text, bigint),
    pgbroker.client_update(text, jsonb, text, bigint),
    pgbroker.client_register(text, jsonb, text, bigint),
    pgbroker._client_key(text, text),
    pgbroker._acting_epoch(text, bigint);
DROP TABLE pgbroker.outbox, pgbroker.interest, pgbroker.subscription, pgbroker.watched, pgbroker.client;

CREATE OR REPLACE FUNCTION pgbroker._lease_clear_state(p_name text, p_epoch bigint)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM pgbroker.state WHERE name = p_name AND epoch < p_epoch;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_clear_state(text, bigint) IS
    'Internal: delete the broker state of lease p_name left by epochs before p_epoch.';
