-- pgbroker: the client registry.
--
-- The broker records the clients connected to it, so a frontend can list
-- them (view pgbroker.clients) and triggers can work out who must hear about
-- a change.  Only the current holder of the lease may change its clients:
-- either from its own session, or from any session that passes the holder's
-- current epoch (checked like broker_assert()).  A new claim wipes the clients
-- of earlier epochs (trigger _200_clear_clients, below).

CREATE TABLE pgbroker.client (
    client_key bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL REFERENCES pgbroker.lease (name) ON DELETE CASCADE,
    epoch bigint NOT NULL,
    client_id text NOT NULL,
    info jsonb NOT NULL DEFAULT '{}',
    registered_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    updated_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    CONSTRAINT client_id_unique UNIQUE (name, client_id),
    CONSTRAINT client_id_valid CHECK (client_id <> '' AND octet_length(client_id) <= 200)
);
CREATE INDEX client_name_epoch ON pgbroker.client (name, epoch);
COMMENT ON TABLE pgbroker.client IS
    'Clients registered by the broker of each lease. Internal: use client_register() and the view pgbroker.clients.';
COMMENT ON COLUMN pgbroker.client.client_key IS 'Internal number of the client; outbox target lists hold these.';
COMMENT ON COLUMN pgbroker.client.name IS 'Lease name of the broker the client is connected to.';
COMMENT ON COLUMN pgbroker.client.epoch IS 'Epoch of the broker that registered it; a new claim deletes clients of earlier epochs.';
COMMENT ON COLUMN pgbroker.client.client_id IS 'Identifier given by the broker (1 to 200 bytes), unique per broker.';
COMMENT ON COLUMN pgbroker.client.info IS 'What the broker knows of the client (address, version...).';
COMMENT ON COLUMN pgbroker.client.registered_at IS 'When it was registered.';
COMMENT ON COLUMN pgbroker.client.updated_at IS 'When its info last changed.';

-- The epoch on whose behalf the caller acts: its own lease when p_epoch is
-- NULL (PB001 unless this session holds it), else p_epoch once checked like
-- broker_assert() (PB002 unless current and alive).
CREATE FUNCTION pgbroker._acting_epoch(p_name text, p_epoch bigint)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_epoch IS NULL THEN
        RETURN pgbroker._holder_epoch(p_name);
    END IF;
    PERFORM pgbroker.broker_assert(p_name, p_epoch);
    RETURN p_epoch;
END
$$;
COMMENT ON FUNCTION pgbroker._acting_epoch(text, bigint) IS
    'Internal: the epoch the caller acts for: its own lease (p_epoch NULL) or p_epoch after a broker_assert().';

CREATE FUNCTION pgbroker._client_key(p_name text, p_client_id text)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_key bigint;
BEGIN
    SELECT client_key INTO v_key FROM pgbroker.client WHERE name = p_name AND client_id = p_client_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'client "%" is not registered with broker "%"', p_client_id, p_name
            USING ERRCODE = 'PB010', HINT = 'Register it first with pgbroker.client_register().';
    END IF;
    RETURN v_key;
END
$$;
COMMENT ON FUNCTION pgbroker._client_key(text, text) IS
    'Internal: the client_key of a registered client, PB010 when unknown.';

CREATE FUNCTION pgbroker.client_register(client_id text, info jsonb DEFAULT '{}', name text DEFAULT 'default', epoch bigint DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(client_register.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, client_register.epoch);
    v_inserted boolean;
BEGIN
    IF client_register.client_id IS NULL THEN
        RAISE EXCEPTION 'client_id must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF client_register.client_id = '' OR octet_length(client_register.client_id) > 200 THEN
        RAISE EXCEPTION 'client_id must be 1 to 200 bytes long, got % bytes', octet_length(client_register.client_id)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO pgbroker.client AS c (name, epoch, client_id, info)
    VALUES (v_name, v_epoch, client_register.client_id, coalesce(client_register.info, '{}'))
    ON CONFLICT ON CONSTRAINT client_id_unique
    DO UPDATE SET info = excluded.info, updated_at = clock_timestamp()
    RETURNING (xmax = 0) INTO v_inserted;
    RETURN v_inserted;
END
$$;
COMMENT ON FUNCTION pgbroker.client_register(text, jsonb, text, bigint) IS
$$Broker only: register client CLIENT_ID (1 to 200 bytes) with INFO (address, version...) for lease NAME.
Call it from the holder's session, or from another session passing the holder's current EPOCH.
Returns true when the client is new, false when it was registered already (its info is then replaced).$$;

CREATE FUNCTION pgbroker.client_update(client_id text, info jsonb, name text DEFAULT 'default', epoch bigint DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(client_update.name);
    v_key bigint;
BEGIN
    PERFORM pgbroker._acting_epoch(v_name, client_update.epoch);
    v_key := pgbroker._client_key(v_name, client_update.client_id);
    UPDATE pgbroker.client SET info = coalesce(client_update.info, '{}'), updated_at = clock_timestamp()
     WHERE client_key = v_key;
END
$$;
COMMENT ON FUNCTION pgbroker.client_update(text, jsonb, text, bigint) IS
    'Broker only: replace the info of registered client CLIENT_ID (PB010 when unknown).';

CREATE FUNCTION pgbroker.client_unregister(client_id text, name text DEFAULT 'default', epoch bigint DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(client_unregister.name);
    v_key bigint;
BEGIN
    PERFORM pgbroker._acting_epoch(v_name, client_unregister.epoch);
    SELECT client_key INTO v_key FROM pgbroker.client c
     WHERE c.name = v_name AND c.client_id = client_unregister.client_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    DELETE FROM pgbroker.client WHERE client_key = v_key;   -- subscriptions go with it (400_subscriptions.sql)
    RETURN true;
END
$$;
COMMENT ON FUNCTION pgbroker.client_unregister(text, text, bigint) IS
    'Broker only: unregister client CLIENT_ID and drop all its subscriptions; false when it was not registered.';

-- A new epoch deletes the clients earlier epochs registered (and with them
-- their subscriptions, by the foreign key).
CREATE TRIGGER _200_clear_clients
AFTER UPDATE OF epoch ON pgbroker.lease
FOR EACH ROW WHEN (NEW.epoch > OLD.epoch)
EXECUTE FUNCTION pgbroker._lease_clear_epochs('client');
COMMENT ON TRIGGER _200_clear_clients ON pgbroker.lease IS 'A new epoch deletes the clients of earlier ones.';
