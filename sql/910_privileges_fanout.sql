-- pgbroker: privileges of the fan-out area (merged into 900_privileges.sql at release).

-- PUBLIC keeps EXECUTE on new functions (ALTER DEFAULT PRIVILEGES IN SCHEMA
-- cannot take away a global default), so revoke it from everything this area
-- created: watch() and the other SECURITY DEFINER functions check no role.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pgbroker FROM PUBLIC;

-- Client registry, subscriptions and delivery (200_clients.sql, 300_watch.sql).
GRANT SELECT ON pgbroker.clients, pgbroker.subscriptions, pgbroker.watched_tables, pgbroker.outbox_pending
TO pgbroker_reader;
GRANT EXECUTE ON FUNCTION
    pgbroker.client_register(text, jsonb, text, bigint),
    pgbroker.client_update(text, jsonb, text, bigint),
    pgbroker.client_unregister(text, text, bigint),
    pgbroker.subscribe(text, regclass, jsonb, text, bigint, interval),
    pgbroker.unsubscribe(text, regclass, jsonb, text, bigint),
    pgbroker.outbox_fetch(text, integer),
    pgbroker.outbox_ack(text, bigint[]),
    pgbroker.broker_wake(text),
    pgbroker.broker_sleep(text, interval),
    pgbroker.wakeup_channel(text)
TO pgbroker_broker;
GRANT EXECUTE ON FUNCTION
    pgbroker.watch(regclass),
    pgbroker.unwatch(regclass)
TO pgbroker_admin;
