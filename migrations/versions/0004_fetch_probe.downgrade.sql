-- Undo 0004_fetch_probe: put back the 0002 definition of outbox_fetch().

CREATE OR REPLACE FUNCTION pgbroker.outbox_fetch(name text DEFAULT 'default', max_rows integer DEFAULT 1000, ack bigint[] DEFAULT NULL)
RETURNS TABLE (id bigint, "table" text, op text, key jsonb, changed text[], clients text[], at timestamptz)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(outbox_fetch.name);
    v_epoch bigint := pgbroker._holder_epoch(v_name);
    v_floor bigint;
BEGIN
    IF outbox_fetch.max_rows IS NULL OR outbox_fetch.max_rows < 1 THEN
        RAISE EXCEPTION 'max_rows must be at least 1' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- First, before this transaction writes anything (see _outbox_floor).
    v_floor := pgbroker._outbox_floor(v_name, v_epoch, true);
    IF outbox_fetch.ack IS NOT NULL THEN
        -- Acknowledge the previous batch in the same round trip.
        DELETE FROM pgbroker.outbox b WHERE b.name = v_name AND b.id = ANY (outbox_fetch.ack);
    END IF;
    RETURN QUERY
    SELECT o.id, w.relid::regclass::text, o.op::text, o.row_key, o.changed,
           ARRAY(SELECT c.client_id FROM unnest(o.clients) WITH ORDINALITY AS u(k, n)
                   JOIN pgbroker.client c ON c.client_key = u.k ORDER BY u.n),
           o.at
      FROM (SELECT * FROM pgbroker.outbox b
             WHERE b.name = v_name AND b.epoch = v_epoch AND b.id > v_floor
             ORDER BY b.id
             LIMIT outbox_fetch.max_rows
               FOR UPDATE SKIP LOCKED) o
      JOIN pgbroker.watched w ON w.watch_id = o.watch_id
     ORDER BY o.id;
END
$$;
