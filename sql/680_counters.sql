-- pgbroker: atomic counters.
--
-- One row per counter; every change is one INSERT ... ON CONFLICT DO UPDATE
-- statement, which PostgreSQL makes atomic under any number of concurrent
-- callers (the row lock serialises them and the update re-reads the row).

CREATE TABLE pgbroker.counter (
    name text PRIMARY KEY,
    value bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp()
);
COMMENT ON TABLE pgbroker.counter IS 'Atomic counters. Internal: use counter_add(), counter_get(), counter_set(), counter_delete() and the view pgbroker.counters.';
COMMENT ON COLUMN pgbroker.counter.name IS 'The counter name, verbatim (1 to 200 bytes).';
COMMENT ON COLUMN pgbroker.counter.value IS 'Its value (an absent counter reads as 0).';
COMMENT ON COLUMN pgbroker.counter.updated_at IS 'When it last changed.';

CREATE FUNCTION pgbroker.counter_add(name text, delta bigint DEFAULT 1)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_value bigint;
BEGIN
    PERFORM pgbroker._name_check('counter', pgbroker._check_key(counter_add.name, 'counter name'), true);
    IF counter_add.delta IS NULL THEN
        RAISE EXCEPTION 'delta must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    INSERT INTO pgbroker.counter AS c (name, value)
    VALUES (counter_add.name, counter_add.delta)
    ON CONFLICT ON CONSTRAINT counter_pkey
    DO UPDATE SET value = c.value + excluded.value, updated_at = clock_timestamp()
    RETURNING c.value INTO v_value;
    RETURN v_value;
END
$$;
COMMENT ON FUNCTION pgbroker.counter_add(text, bigint) IS
    'Add DELTA (default 1, may be negative) to counter NAME (created at 0) in one atomic statement and return the new value; 22003 when it would leave the bigint range.';

CREATE FUNCTION pgbroker.counter_get(name text)
RETURNS bigint
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pgbroker._name_check('counter', pgbroker._check_key(counter_get.name, 'counter name'), false);
    SELECT coalesce((SELECT c.value FROM pgbroker.counter c WHERE c.name = counter_get.name), 0);
$$;
COMMENT ON FUNCTION pgbroker.counter_get(text) IS 'The value of counter NAME; 0 when it does not exist.';

CREATE FUNCTION pgbroker.counter_set(name text, value bigint, expected bigint DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_key(counter_set.name, 'counter name');
BEGIN
    PERFORM pgbroker._name_check('counter', v_name, true);
    IF counter_set.value IS NULL THEN
        RAISE EXCEPTION 'value must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF counter_set.expected IS NULL OR counter_set.expected = 0 THEN
        -- Unconditional, or "currently 0", which an absent counter is too.
        INSERT INTO pgbroker.counter AS c (name, value) VALUES (v_name, counter_set.value)
        ON CONFLICT ON CONSTRAINT counter_pkey
        DO UPDATE SET value = excluded.value, updated_at = clock_timestamp()
         WHERE counter_set.expected IS NULL OR c.value = 0;
    ELSE
        UPDATE pgbroker.counter c SET value = counter_set.value, updated_at = clock_timestamp()
         WHERE c.name = v_name AND c.value = counter_set.expected;
    END IF;
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION pgbroker.counter_set(text, bigint, bigint) IS
    'Set counter NAME to VALUE and return true; with EXPECTED only when its current value is EXPECTED (an absent counter is 0): false, changing nothing, otherwise.';

-- A counter is data: it stays until deleted, however long nobody touches it.
-- A service that counts per entity (per order, per user) deletes an entity's
-- counter when it is done with it; nothing else removes it.
CREATE FUNCTION pgbroker.counter_delete(name text, expected bigint DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_key(counter_delete.name, 'counter name');
BEGIN
    PERFORM pgbroker._name_check('counter', v_name, true);
    DELETE FROM pgbroker.counter c
     WHERE c.name = v_name AND (counter_delete.expected IS NULL OR c.value = counter_delete.expected);
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION pgbroker.counter_delete(text, bigint) IS
    'Delete counter NAME (it reads as 0 again) and return true; with EXPECTED only when its value is EXPECTED. False, changing nothing, when it does not exist or its value differs.';
