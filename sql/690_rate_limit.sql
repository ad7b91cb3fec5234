-- pgbroker: rate limits (GCRA, judged on the database server's clock).
--
-- rate_limit(name, rate, per, burst, cost) allows at most RATE calls per PER
-- on average and at most BURST (default RATE) at once, for every caller of
-- NAME on every application server: one statement per decision, on the
-- server's clock_timestamp(), so the application servers' clocks and their
-- skew do not matter.
--
-- The algorithm is GCRA (the generic cell rate algorithm, as redis-cell and
-- the ATM networks use it), which is a token bucket kept as one number: the
-- theoretical arrival time TAT of a name.  With the emission interval
-- T = PER / RATE, a call of COST at time NOW is allowed when
--     max(TAT, NOW) + COST*T - NOW <= BURST*T,   i.e.   TAT <= NOW + (BURST - COST)*T
-- and then sets TAT to max(TAT, NOW) + COST*T; a denied call leaves TAT as it
-- was, so it costs later callers nothing.  Each allowed unit advances TAT by
-- T and TAT never passes NOW + BURST*T, so the allowed units of any set of
-- calls whose clock readings lie within an interval of length E number at
-- most BURST + E/T = BURST + RATE*E/PER, whatever their order.
--
-- Exact arithmetic.  Times are numeric counts of femtoseconds (10^-15 s)
-- since the epoch: clock_timestamp() has microseconds, so NOW is exact, and
-- T is PER/RATE rounded *up* to a whole femtosecond (exact integer division),
-- so rounding can only make the limit stricter, by at most one part in 10^9
-- for 10^6 calls per second.  Any integer RATE, BURST and COST and any
-- positive PER (a month counts 30 days, as extract(epoch) counts it) work,
-- with nothing to overflow.
--
-- Concurrency.  The decision is one INSERT ... ON CONFLICT DO UPDATE: the
-- row lock serialises the callers of a name and each decides on the latest
-- TAT.  NOW is read before the statement, so a caller that waited for the
-- row lock decides with a NOW older than the TAT it finds: that can only
-- deny it more (TAT - NOW is larger), never allow more.  Calls of different
-- names never wait for each other.  Parameters may differ between calls of
-- one name (each call is judged by its own): TAT is a time, so what earlier
-- calls used stays counted when RATE, PER or BURST change.
--
-- Crashes.  The state is an UNLOGGED table: no WAL on the callers' path, and
-- standbys do not have it.  Crash recovery (and a failover) empties it, so
-- every limit starts full again: the limiter fails open to a full bucket,
-- allowing at most one extra BURST per name.  A clean restart keeps it.
-- Safe after a promotion: nothing in it must survive one (no row is a full
-- bucket), and it has no sequence or identity column, nothing whose loss or
-- corruption could block a caller; its only index, the primary key, comes
-- back empty and usable (tests/faults/test_failover_unlogged.py calls
-- rate_limit() on a standby promoted without a restartpoint).
--
-- Operators see the view pgbroker.rate_limits (700_views.sql) and the
-- aggregate metrics of pgbroker.metrics (750_console.sql).

CREATE UNLOGGED TABLE pgbroker.rate_limit_state (
    name text PRIMARY KEY,
    tat numeric NOT NULL,
    rate integer NOT NULL,
    per interval NOT NULL,
    burst integer NOT NULL,
    allowed bigint NOT NULL,
    denied bigint NOT NULL,
    last_allowed boolean NOT NULL,
    updated_at timestamptz NOT NULL
) WITH (fillfactor = 50);   -- room on each page for HOT updates: every decision rewrites its row
COMMENT ON TABLE pgbroker.rate_limit_state IS
    'GCRA state of each rate limit (UNLOGGED: emptied by a crash, so every limit starts full). Internal: use rate_limit() and the view pgbroker.rate_limits.';
COMMENT ON COLUMN pgbroker.rate_limit_state.name IS 'The rate limit name, verbatim (1 to 200 bytes).';
COMMENT ON COLUMN pgbroker.rate_limit_state.tat IS
    'Theoretical arrival time, in femtoseconds since the epoch: a call of cost C is allowed when tat <= now + (burst - C) * per / rate.';
COMMENT ON COLUMN pgbroker.rate_limit_state.rate IS 'RATE of the last call.';
COMMENT ON COLUMN pgbroker.rate_limit_state.per IS 'PER of the last call.';
COMMENT ON COLUMN pgbroker.rate_limit_state.burst IS 'BURST of the last call (RATE when it passed NULL).';
COMMENT ON COLUMN pgbroker.rate_limit_state.allowed IS 'Calls allowed since the row was created (a crash resets it).';
COMMENT ON COLUMN pgbroker.rate_limit_state.denied IS 'Calls denied since the row was created (a crash resets it).';
COMMENT ON COLUMN pgbroker.rate_limit_state.last_allowed IS 'Whether the last call was allowed.';
COMMENT ON COLUMN pgbroker.rate_limit_state.updated_at IS 'Server clock of the last call.';

-- The emission interval PER/RATE in femtoseconds, rounded up.  No SET
-- clause (it is inlined into its callers, which pin their search_path), every
-- name qualified.
CREATE FUNCTION pgbroker._rate_limit_interval(p_rate integer, p_per interval)
RETURNS numeric
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT pg_catalog.div(EXTRACT(epoch FROM p_per) * 1000000000000000 + p_rate - 1, p_rate::numeric) $$;
COMMENT ON FUNCTION pgbroker._rate_limit_interval(integer, interval) IS
    'Internal: the GCRA emission interval PER / RATE in femtoseconds, rounded up (so that rounding never allows more).';

-- A number of microseconds as an interval of hours, minutes and seconds
-- only (no days, which timestamptz arithmetic would take as calendar days),
-- saturating at 9 * 10^18 microseconds (285,000 years).
CREATE FUNCTION pgbroker._rate_limit_duration(p_us numeric)
RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT pg_catalog.make_interval(secs => least(p_us, 9000000000000000000) / 1000000) $$;
COMMENT ON FUNCTION pgbroker._rate_limit_duration(numeric) IS
    'Internal: P_US microseconds as an interval without days (saturating at 9 * 10^18 microseconds).';

-- Why a call's parameters are refused; NULL when they are valid.
CREATE FUNCTION pgbroker._rate_limit_invalid(p_rate integer, p_per interval, p_burst integer, p_cost integer)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN p_rate IS NULL OR p_rate <= 0 THEN pg_catalog.format('rate must be a positive integer, got %s', coalesce(p_rate::text, 'NULL'))
        WHEN p_per IS NULL OR EXTRACT(epoch FROM p_per) <= 0 THEN pg_catalog.format('per must be a positive interval, got %s', coalesce(p_per::text, 'NULL'))
        WHEN p_burst <= 0 THEN pg_catalog.format('burst must be a positive integer or NULL (RATE), got %s', p_burst)
        WHEN p_cost IS NULL OR p_cost <= 0 THEN pg_catalog.format('cost must be a positive integer, got %s', coalesce(p_cost::text, 'NULL'))
        WHEN p_cost > coalesce(p_burst, p_rate) THEN
            pg_catalog.format('cost %s is above the burst %s: such a call could never be allowed', p_cost, coalesce(p_burst, p_rate))
    END
$$;
COMMENT ON FUNCTION pgbroker._rate_limit_invalid(integer, interval, integer, integer) IS
    'Internal: why rate_limit() refuses these parameters (22023), or NULL when they are valid.';

CREATE FUNCTION pgbroker.rate_limit(name text, rate integer, per interval, burst integer DEFAULT NULL,
                                    cost integer DEFAULT 1)
RETURNS TABLE (allowed boolean, retry_after interval, remaining integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := rate_limit.name;
    v_burst integer := coalesce(rate_limit.burst, rate_limit.rate);
    v_now numeric;      -- femtoseconds since the epoch
    v_t numeric;        -- the emission interval, femtoseconds
    v_limit numeric;    -- allowed when tat <= v_limit
    v_tat numeric;
    v_reason text;
BEGIN
    -- The hot path: checks inline; the helpers only word the error.
    IF v_name IS NULL OR v_name = '' OR octet_length(v_name) > 200 THEN
        PERFORM pgbroker._check_key(v_name, 'rate limit name');   -- 22023 with its message
    END IF;
    IF rate_limit.rate IS NULL OR rate_limit.rate <= 0 OR rate_limit.per IS NULL OR v_burst <= 0
       OR rate_limit.cost IS NULL OR rate_limit.cost <= 0 OR rate_limit.cost > v_burst
       OR EXTRACT(epoch FROM rate_limit.per) <= 0 THEN
        v_reason := pgbroker._rate_limit_invalid(rate_limit.rate, rate_limit.per, rate_limit.burst, rate_limit.cost);
        RAISE EXCEPTION '%', v_reason USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pgbroker._name_check('rate_limit', v_name, true);
    v_now := EXTRACT(epoch FROM clock_timestamp()) * 1000000000000000;
    v_t := pgbroker._rate_limit_interval(rate_limit.rate, rate_limit.per);
    v_limit := v_now + (v_burst - rate_limit.cost) * v_t;
    INSERT INTO pgbroker.rate_limit_state AS s
           (name, tat, rate, per, burst, allowed, denied, last_allowed, updated_at)
    VALUES (v_name, v_now + rate_limit.cost * v_t, rate_limit.rate, rate_limit.per, v_burst, 1, 0, true,
            clock_timestamp())
    ON CONFLICT ON CONSTRAINT rate_limit_state_pkey DO UPDATE
       SET tat = CASE WHEN s.tat <= v_limit THEN greatest(s.tat, v_now) + rate_limit.cost * v_t ELSE s.tat END,
           allowed = s.allowed + (s.tat <= v_limit)::integer,
           denied = s.denied + (s.tat > v_limit)::integer,
           last_allowed = s.tat <= v_limit,
           rate = excluded.rate, per = excluded.per, burst = excluded.burst, updated_at = excluded.updated_at
    RETURNING s.tat, s.last_allowed INTO v_tat, rate_limit.allowed;
    IF rate_limit.allowed THEN
        rate_limit.retry_after := '0';
    ELSE
        -- Until tat <= now + (burst - cost) * T, rounded up to the microsecond.
        rate_limit.retry_after := pgbroker._rate_limit_duration(ceil((v_tat - v_limit) / 1000000000));
    END IF;
    rate_limit.remaining := greatest(pg_catalog.div(v_limit + rate_limit.cost * v_t - v_tat, v_t), 0);
    RETURN NEXT;
END
$$;
COMMENT ON FUNCTION pgbroker.rate_limit(text, integer, interval, integer, integer) IS
$$Decide one call of COST (default 1) against the rate limit NAME (1 to 200 bytes): at most RATE per PER on average, and at most BURST (NULL: RATE) at once, for all callers of NAME together.
Returns allowed; retry_after, '0' when allowed, else how long until a call of this COST can be allowed (nobody else calling meanwhile); remaining, how many calls of cost 1 would be allowed right after this one.
GCRA on the server's clock, one statement per decision: concurrent callers are never allowed more than BURST + RATE * elapsed / PER, and a denied call uses nothing up. Works through any pooler; the name's row stays locked until the transaction ends, so call it in autocommit mode or last in a short transaction.
22023 for a bad name, or a RATE, PER, BURST or COST that is NULL (BURST may be), zero or negative, or a COST above BURST; nothing is changed then.
The state is UNLOGGED: a crash (or failover) forgets it and every limit starts full.$$;

-- A bucket that is full again (tat <= now: every unit has been earned back)
-- decides every call as a missing row does, so maintain() deletes such rows
-- (their allowed and denied counts go with them), a batch at a time,
-- skipping rows a caller holds.  A caller waiting for a row being deleted
-- then inserts a fresh, full, row.
CREATE FUNCTION pgbroker._rate_limit_upkeep(p_max integer, OUT removed bigint, OUT remaining bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now numeric := EXTRACT(epoch FROM clock_timestamp()) * 1000000000000000;
BEGIN
    DELETE FROM pgbroker.rate_limit_state s
     WHERE s.ctid = ANY (ARRAY(SELECT x.ctid FROM pgbroker.rate_limit_state x
                                WHERE x.tat <= v_now LIMIT p_max FOR UPDATE SKIP LOCKED))
       AND s.tat <= v_now;
    GET DIAGNOSTICS removed = ROW_COUNT;
    SELECT count(*) INTO remaining
      FROM (SELECT FROM pgbroker.rate_limit_state x WHERE x.tat <= v_now LIMIT p_max) x;
END
$$;
COMMENT ON FUNCTION pgbroker._rate_limit_upkeep(integer) IS
    'Internal (maintain()): delete up to P_MAX rate limits whose bucket is full again (indistinguishable from no row); REMOVED deleted, REMAINING full ones left (at most P_MAX counted).';
