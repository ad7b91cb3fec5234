-- pgbroker: sweeping what earlier epochs left.
--
-- A claim does not delete what the lease's earlier epochs left (broker
-- state, clients, subscriptions, interest, pending notifications): it makes
-- it invisible, since every reader compares the epoch with the lease's, so a
-- takeover costs the same whether the dead broker had no client or a
-- hundred thousand.  broker_sweep() deletes those rows afterwards, a bounded
-- batch per call, in a short transaction of its own.  A new epoch's rows
-- never share a key with an earlier epoch's (every key of these tables holds
-- the epoch, or a client of one epoch), so nobody waits for the rows a sweep
-- locks: writers, subscribers and the new broker go on as if it did not run.
-- The Python Broker sweeps after its claim; a broker in another language
-- calls broker_sweep() until it returns 0 (its loop's idle turn is a good
-- place), and the view pgbroker.sweep_backlog shows what is left.

CREATE FUNCTION pgbroker.broker_sweep(name text DEFAULT NULL, max_rows integer DEFAULT 10000)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_left bigint := broker_sweep.max_rows;
    v_done bigint;
    v_lease record;
    v_clients bigint[];
BEGIN
    IF broker_sweep.name IS NOT NULL THEN
        PERFORM pgbroker._check_name(broker_sweep.name);
    END IF;
    IF broker_sweep.max_rows IS NULL OR broker_sweep.max_rows < 1 THEN
        RAISE EXCEPTION 'max_rows must be at least 1, got %', coalesce(broker_sweep.max_rows::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The janitor's other duty: TTL leases that lapsed unnoticed (100_lease.sql).
    PERFORM pgbroker._lease_expire(broker_sweep.name);
    -- Rows another sweep has locked are skipped (FOR UPDATE SKIP LOCKED): two
    -- sweeps never wait for each other either.  Clients go MAX_ROWS / 16 at a
    -- time with all their subscriptions, so a batch is larger than MAX_ROWS
    -- only when they have more than 15 each.
    FOR v_lease IN SELECT l.name, l.epoch FROM pgbroker.lease l
                    WHERE broker_sweep.name IS NULL OR l.name = broker_sweep.name
                    ORDER BY l.name LOOP
        DELETE FROM pgbroker.outbox o
         WHERE o.ctid = ANY (ARRAY(SELECT x.ctid FROM pgbroker.outbox x
                                    WHERE x.name = v_lease.name AND x.epoch < v_lease.epoch
                                    LIMIT v_left FOR UPDATE SKIP LOCKED));
        GET DIAGNOSTICS v_done = ROW_COUNT;
        v_left := v_left - v_done;
        EXIT WHEN v_left <= 0;
        DELETE FROM pgbroker.outbox_departed d
         WHERE d.ctid = ANY (ARRAY(SELECT x.ctid FROM pgbroker.outbox_departed x
                                    WHERE x.name = v_lease.name AND x.epoch < v_lease.epoch
                                    LIMIT v_left FOR UPDATE SKIP LOCKED));
        GET DIAGNOSTICS v_done = ROW_COUNT;
        v_left := v_left - v_done;
        EXIT WHEN v_left <= 0;
        DELETE FROM pgbroker.interest i
         WHERE i.ctid = ANY (ARRAY(SELECT x.ctid FROM pgbroker.interest x
                                    WHERE x.name = v_lease.name AND x.epoch < v_lease.epoch
                                    LIMIT v_left FOR UPDATE SKIP LOCKED));
        GET DIAGNOSTICS v_done = ROW_COUNT;
        v_left := v_left - v_done;
        EXIT WHEN v_left <= 0;
        -- A batch of the earlier epochs' clients, their subscriptions first
        -- (found by their key: never a scan past clients already emptied).
        v_clients := ARRAY(SELECT x.client_key FROM pgbroker.client x
                            WHERE x.name = v_lease.name AND x.epoch < v_lease.epoch
                            LIMIT greatest(v_left / 16, 1) FOR UPDATE SKIP LOCKED);
        DELETE FROM pgbroker.subscription s WHERE s.client_key = ANY (v_clients);
        GET DIAGNOSTICS v_done = ROW_COUNT;
        v_left := v_left - v_done;
        DELETE FROM pgbroker.client c WHERE c.client_key = ANY (v_clients);
        GET DIAGNOSTICS v_done = ROW_COUNT;
        v_left := v_left - v_done;
        EXIT WHEN v_left <= 0;
        DELETE FROM pgbroker.state s
         WHERE s.ctid = ANY (ARRAY(SELECT x.ctid FROM pgbroker.state x
                                    WHERE x.name = v_lease.name AND x.epoch < v_lease.epoch
                                    LIMIT v_left FOR UPDATE SKIP LOCKED));
        GET DIAGNOSTICS v_done = ROW_COUNT;
        v_left := v_left - v_done;
        EXIT WHEN v_left <= 0;
    END LOOP;
    RETURN broker_sweep.max_rows - v_left;
END
$$;
COMMENT ON FUNCTION pgbroker.broker_sweep(text, integer) IS
$$Delete about MAX_ROWS rows that earlier epochs of lease NAME (NULL: of every lease) left behind: pending notifications (and the clients departed from them), interest, clients with their subscriptions, broker state, in that order. Returns how many it deleted: call it again until it returns 0. Also records and announces TTL leases that expired unnoticed (lease_expiry_check).
Those rows are invisible from the moment a new epoch is claimed; sweeping only frees their space. Nobody waits for a sweep (writers, subscribers and the new broker never touch those rows), and two sweeps skip each other's rows. Call it in autocommit mode, so each batch commits on its own.$$;
