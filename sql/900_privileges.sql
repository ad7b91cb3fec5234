-- pgbroker: who may do what, in one place.
--
-- PUBLIC gets nothing.  Three NOLOGIN roles (created in 000_schema.sql) are
-- granted to the user's own login roles:
--   pgbroker_reader  SELECT on the views, nothing else
--   pgbroker_broker  claim, release, heartbeat, assert, broker state
--   pgbroker_admin   everything, including takeover => true
-- Tables are never granted: the functions (SECURITY DEFINER, search_path
-- pinned) and the views are the interface.

REVOKE ALL ON SCHEMA pgbroker FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA pgbroker FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA pgbroker FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pgbroker FROM PUBLIC;
-- (ALTER DEFAULT PRIVILEGES IN SCHEMA cannot take away the global default
-- EXECUTE for PUBLIC, so every revision revokes what it created, as above.)

GRANT pgbroker_broker, pgbroker_reader TO pgbroker_admin;
GRANT USAGE ON SCHEMA pgbroker TO pgbroker_broker, pgbroker_reader, pgbroker_admin;

-- Readers: the views (and the helper the brokers view calls).
GRANT SELECT ON pgbroker.brokers, pgbroker.lease_history, pgbroker.broker_state TO pgbroker_reader;
GRANT EXECUTE ON FUNCTION
    pgbroker._lease_alive(integer, timestamptz, integer),
    pgbroker._lock_class()
TO pgbroker_reader;

-- Brokers: the lease and broker-state API.
GRANT EXECUTE ON FUNCTION
    pgbroker.broker_claim(text, interval, boolean, interval, text),
    pgbroker.broker_release(text),
    pgbroker.broker_heartbeat(text),
    pgbroker.broker_assert(text, bigint),
    pgbroker.broker_state_set(text, text, jsonb),
    pgbroker.broker_state_delete(text, text),
    pgbroker._lease_claim(text, interval, integer, interval, text),
    pgbroker._check_name(text),
    pgbroker._wait_ms(interval),
    pgbroker._lock_class()
TO pgbroker_broker;

-- Admins: takeover and housekeeping.
GRANT EXECUTE ON FUNCTION
    pgbroker._lease_takeover(text),
    pgbroker.lease_history_prune(interval)
TO pgbroker_admin;

-- ===========================================================================
-- Fan-out area (200_clients.sql, 300_watch.sql), since revision 0002_fanout.

-- Functions of this area are created with EXECUTE for PUBLIC: take it back
-- (watch() and the other SECURITY DEFINER functions check no role themselves).
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pgbroker FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA pgbroker FROM PUBLIC;

-- Client registry, subscriptions and delivery (200_clients.sql, 300_watch.sql).
GRANT SELECT ON pgbroker.clients, pgbroker.subscriptions, pgbroker.watched_tables, pgbroker.outbox_pending
TO pgbroker_reader;
GRANT EXECUTE ON FUNCTION
    pgbroker.client_register(text, jsonb, text, bigint),
    pgbroker.client_update(text, jsonb, text, bigint),
    pgbroker.client_unregister(text, text, bigint),
    pgbroker.subscribe(text, regclass, jsonb, text, bigint, interval),
    pgbroker.unsubscribe(text, regclass, jsonb, text, bigint),
    pgbroker.outbox_fetch(text, integer, bigint[]),
    pgbroker.outbox_ack(text, bigint[]),
    pgbroker.broker_wake(text),
    pgbroker.broker_sleep(text, interval),
    pgbroker.wakeup_channel(text)
TO pgbroker_broker;
GRANT EXECUTE ON FUNCTION
    pgbroker.watch(regclass),
    pgbroker.unwatch(regclass)
TO pgbroker_admin;
