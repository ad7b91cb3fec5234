-- pgbroker: the console.  What an operator reads at 3 a.m. in psql, what
-- `pgbroker status` and `pgbroker doctor` print (they read these views, so
-- psql and the CLI agree) and what Prometheus scrapes.  Built only on the
-- views of 700_views.sql and on pg_catalog, never on pgbroker's tables, so
-- that a reader sees here what it may see there (but for lock_audit, which
-- matches pg_locks with the lock registries, as no view could).

-- ---------------------------------------------------------------------------
-- One row per broker: the lease, its clients and its outbox backlog.

CREATE VIEW pgbroker.broker_overview AS
SELECT b.name,
       b.epoch,
       b.state,
       b.alive,
       b.holder_pid,
       b.holder_application,
       b.heartbeat_age,
       (SELECT count(*) FROM pgbroker.lease_history h
         WHERE h.name = b.name AND h.event IN ('takeover', 'stale_takeover'))::integer AS takeovers,
       (SELECT count(*) FROM pgbroker.clients c WHERE c.name = b.name)::integer AS clients,
       (SELECT COALESCE(sum(c.subscriptions), 0) FROM pgbroker.clients c WHERE c.name = b.name)::integer AS subscriptions,
       COALESCE(o.pending, 0)::bigint AS outbox_backlog,
       pg_catalog.clock_timestamp() - o.oldest AS outbox_oldest_age,
       (w.clients + w.subscriptions + w.interest + w.outbox + w.state)::bigint AS sweep_backlog,
       b.claimed_at
  FROM pgbroker.brokers b
  LEFT JOIN pgbroker.outbox_pending o ON o.name = b.name
  LEFT JOIN pgbroker.sweep_backlog w ON w.name = b.name;
COMMENT ON VIEW pgbroker.broker_overview IS
    'One row per broker (lease name): holder, liveness, takeovers, clients, subscriptions, outbox backlog and what is left to sweep. What pgbroker status shows.';
COMMENT ON COLUMN pgbroker.broker_overview.name IS 'Lease name.';
COMMENT ON COLUMN pgbroker.broker_overview.epoch IS 'Current epoch (fencing token).';
COMMENT ON COLUMN pgbroker.broker_overview.state IS 'new, held, released or expired.';
COMMENT ON COLUMN pgbroker.broker_overview.alive IS 'True when the recorded holder''s backend exists and holds the lock.';
COMMENT ON COLUMN pgbroker.broker_overview.holder_pid IS 'Backend pid of the (last) holder.';
COMMENT ON COLUMN pgbroker.broker_overview.holder_application IS 'Its application_name at claim time.';
COMMENT ON COLUMN pgbroker.broker_overview.heartbeat_age IS 'Time since the holder''s last heartbeat.';
COMMENT ON COLUMN pgbroker.broker_overview.takeovers IS 'Takeovers (forced or stale) recorded in pgbroker.lease_history (pruning forgets old ones).';
COMMENT ON COLUMN pgbroker.broker_overview.clients IS 'Clients registered by the live holder (pgbroker.clients).';
COMMENT ON COLUMN pgbroker.broker_overview.subscriptions IS 'Subscriptions of those clients.';
COMMENT ON COLUMN pgbroker.broker_overview.outbox_backlog IS 'Notifications not yet acknowledged (pgbroker.outbox_pending).';
COMMENT ON COLUMN pgbroker.broker_overview.outbox_oldest_age IS 'Age of the oldest of them; NULL when there is none.';
COMMENT ON COLUMN pgbroker.broker_overview.sweep_backlog IS 'Rows earlier epochs left that broker_sweep() has yet to delete (pgbroker.sweep_backlog).';
COMMENT ON COLUMN pgbroker.broker_overview.claimed_at IS 'When the current epoch was claimed.';

-- ---------------------------------------------------------------------------
-- Locks no record accounts for.  Advisory locks have no privileges: any
-- session can take any key of pgbroker's lock classes, squatting a named
-- lock, a permit, a lease's lock or a table's watch lock (a denial of
-- service; it can never make a session a lease's holder).  This lists the
-- sessions that hold such a lock without a pgbroker record behind it: a
-- lease lock or a broker's liveness or wake-up lock held by another session
-- than the lease's recorded holder, a named lock or permit never registered
-- or held by a role the name grants refuse, a lock the API only takes for a
-- transaction held by a session outside one.  A session in the middle of a
-- statement (a claim committing) is left out: what it holds is momentary.
-- One whose claim sits in a transaction not yet committed is listed until it
-- commits: its lease's lock is held, the record not yet visible.
-- Whether a session is in a transaction is read from pg_locks, which every
-- role sees whole (a transaction holds its own virtualxid lock; a session
-- outside one holds none), so that squatters are found whatever the rights
-- of the role that installed pgbroker.  pg_stat_activity shows other roles'
-- state and application_name only to a role with pg_read_all_stats: where it
-- does, a session in the middle of a statement is told apart (left out);
-- where not, application is NULL and such a session counts as idle in its
-- transaction.

CREATE FUNCTION pgbroker.lock_audit()
RETURNS TABLE (pid integer, role name, application text, session_state text, lock_class text, key integer,
               mode text, why text)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH in_transaction AS MATERIALIZED (
        SELECT v.pid FROM pg_catalog.pg_locks v WHERE v.locktype = 'virtualxid' AND v.granted AND v.pid IS NOT NULL)
    SELECT x.pid, x.role, x.application, x.session_state, x.lock_class, x.key, x.mode, x.why
      FROM (SELECT l.pid, a.usename AS role, a.application_name AS application,
                   coalesce(a.state, CASE WHEN l.pid IN (SELECT t.pid FROM in_transaction t) THEN 'idle in transaction'
                                          ELSE 'idle' END) AS session_state,
                   c.lock_class, l.objid::integer AS key, l.mode,
                   CASE
                       WHEN a.state = 'active' THEN NULL
                       WHEN c.lock_class = 'lease' THEN
                           CASE WHEN EXISTS (SELECT FROM pgbroker.lease r
                                              WHERE r.lock_key = l.objid::integer AND r.state = 'held'
                                                AND r.holder_pid = l.pid) THEN NULL
                                ELSE 'a lease''s lock, and this session is not its recorded holder' END
                       WHEN c.lock_class = 'lease alive' THEN
                           CASE WHEN EXISTS (SELECT FROM pgbroker.lease r
                                              WHERE pgbroker._epoch_key(r.epoch) = l.objid::integer
                                                AND r.state = 'held' AND r.holder_pid = l.pid) THEN NULL
                                ELSE 'an epoch''s liveness lock, and this session is not its holder' END
                       WHEN c.lock_class = 'broker awake' THEN
                           CASE WHEN EXISTS (SELECT FROM pgbroker.lease r
                                              WHERE r.lock_key = l.objid::integer AND r.holder_pid = l.pid) THEN NULL
                                ELSE 'a broker''s wake-up lock, and this session is not its holder' END
                       WHEN c.lock_class = 'lock' THEN
                           CASE WHEN n.name IS NULL THEN 'a named lock''s key that no name was given'
                                WHEN NOT pgbroker.name_allowed('lock', n.name, 'write', a.usesysid::regrole)
                                    THEN format('named lock "%s", which the name grants refuse to %s', n.name, a.usename)
                           END
                       WHEN c.lock_class = 'semaphore permit' THEN
                           CASE WHEN sp.name IS NULL THEN 'a permit''s key that no semaphore was given'
                                WHEN NOT pgbroker.name_allowed('semaphore', sp.name, 'write', a.usesysid::regrole)
                                    THEN format('a permit of semaphore "%s", which the name grants refuse to %s',
                                                sp.name, a.usename)
                           END
                       WHEN c.lock_class = 'kv watchers' AND l.objid = 1 THEN NULL
                       WHEN c.lock_class = 'registry watchers' THEN NULL
                       -- The rest pgbroker takes for a statement or a transaction only: held by
                       -- a session outside any transaction, it is a session lock taken by hand.
                       WHEN a.state = 'idle' OR (a.state IS NULL AND l.pid NOT IN (SELECT t.pid FROM in_transaction t))
                           THEN format('a %s lock, which pgbroker only takes inside a statement or transaction', c.lock_class)
                   END AS why
              FROM pg_catalog.pg_locks l
              JOIN (VALUES (1885823602, 'lease'), (1885823592, 'lease alive'), (1885823585, 'broker awake'),
                           (1885823607, 'broker drain'), (1885823603, 'table watch'), (1885823596, 'lock'),
                           (1885823597, 'semaphore permit'), (1885823595, 'kv watchers'),
                           (1885823591, 'registry watchers'), (1885823590, 'registry writes'))
                   AS c(classid, lock_class) ON c.classid = l.classid::bigint
              LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
              LEFT JOIN pgbroker.lock_name n ON c.lock_class = 'lock' AND n.key = l.objid::integer
              LEFT JOIN pgbroker.semaphore_permit sp ON c.lock_class = 'semaphore permit' AND sp.key = l.objid::integer
             WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
               AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = current_database())
               AND l.pid <> pg_backend_pid()) x
     WHERE x.why IS NOT NULL
$$;
COMMENT ON FUNCTION pgbroker.lock_audit() IS
$$The sessions holding an advisory lock of one of pgbroker's lock classes that no pgbroker record accounts for (squatters, or a client that took a lock by hand), with their role, application, state, the lock and why it is unaccounted. What the view unaccounted_locks and pgbroker doctor show.$$;

CREATE VIEW pgbroker.unaccounted_locks AS
SELECT pid, role, application, session_state, lock_class, key, mode, why FROM pgbroker.lock_audit();
COMMENT ON VIEW pgbroker.unaccounted_locks IS
    'Sessions holding a lock of pgbroker''s lock classes that no pgbroker record accounts for: advisory locks have no privileges, so a role can squat one (a denial of service). End such a session with pg_terminate_backend(pid).';
COMMENT ON COLUMN pgbroker.unaccounted_locks.pid IS 'Backend pid of the session holding it.';
COMMENT ON COLUMN pgbroker.unaccounted_locks.role IS 'Its login role.';
COMMENT ON COLUMN pgbroker.unaccounted_locks.application IS 'Its application_name (NULL for another role''s session when the role that installed pgbroker lacks pg_read_all_stats).';
COMMENT ON COLUMN pgbroker.unaccounted_locks.session_state IS 'Its state (idle, idle in transaction, active...; without pg_read_all_stats, another role''s session is idle or idle in transaction, as pg_locks tells).';
COMMENT ON COLUMN pgbroker.unaccounted_locks.lock_class IS 'Which of pgbroker''s locks: lease, lease alive, broker awake, broker drain, table watch, lock, semaphore permit, kv watchers, registry watchers, registry writes.';
COMMENT ON COLUMN pgbroker.unaccounted_locks.key IS 'The second key of the advisory lock.';
COMMENT ON COLUMN pgbroker.unaccounted_locks.mode IS 'ExclusiveLock or ShareLock.';
COMMENT ON COLUMN pgbroker.unaccounted_locks.why IS 'Why no record accounts for it.';

-- ---------------------------------------------------------------------------
-- Health checks that the database alone can answer.  `pgbroker doctor` adds
-- the ones only the client sees (schema version against the package, the
-- connection's pooler and keepalives, its role's grants).

CREATE VIEW pgbroker.health AS
SELECT 'notify_queue'::text AS "check",
       ''::text AS subject,
       pg_catalog.pg_notification_queue_usage() < 0.5 AS ok,
       pg_catalog.format('the NOTIFY queue is %s%% full', round((pg_catalog.pg_notification_queue_usage() * 100)::numeric, 1)) AS detail,
       CASE WHEN pg_catalog.pg_notification_queue_usage() >= 0.5
            THEN 'a session that LISTENs does not consume its notifications (an open transaction holds the queue back): find it in pg_stat_activity and end it' END AS fix
UNION ALL
SELECT 'outbox_lag', o.name,
       o.outbox_oldest_age IS NULL OR o.outbox_oldest_age < interval '60 s',
       CASE WHEN o.outbox_backlog = 0 THEN 'no pending notification'
            ELSE pg_catalog.format('%s pending notification(s), the oldest %s old', o.outbox_backlog,
                                   date_trunc('second', o.outbox_oldest_age)) END,
       CASE WHEN o.outbox_oldest_age >= interval '60 s'
            THEN CASE WHEN o.alive THEN 'the broker does not fetch and acknowledge its outbox (outbox_fetch, outbox_ack): check its logs'
                      ELSE 'no live broker holds this lease: start one (its claim wipes the old epoch''s outbox)' END END
  FROM pgbroker.broker_overview o
UNION ALL
SELECT 'watch_triggers', w."table"::text,
       t.missing = '{}',
       CASE WHEN t.missing = '{}' THEN 'its four triggers are in place and enabled'
            ELSE pg_catalog.format('missing or disabled: %s', pg_catalog.array_to_string(t.missing, ', ')) END,
       CASE WHEN t.missing <> '{}'
            THEN pg_catalog.format('reinstall them as pgbroker_admin: SELECT pgbroker.watch(%L);', w."table"::text) END
  FROM pgbroker.watched_tables w
  CROSS JOIN LATERAL (
      SELECT ARRAY(SELECT e.name
                     FROM unnest(ARRAY['_pgbroker_watch_ins', '_pgbroker_watch_upd',
                                       '_pgbroker_watch_del', '_pgbroker_watch_trunc']) AS e(name)
                    WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_trigger g
                                       WHERE g.tgrelid = w."table"::oid AND g.tgname = e.name
                                         AND g.tgenabled <> 'D')
                    ORDER BY e.name) AS missing) t
UNION ALL
SELECT 'sweep', o.name,
       o.sweep_backlog = 0 OR o.claimed_at > pg_catalog.clock_timestamp() - interval '5 min',
       CASE WHEN o.sweep_backlog = 0 THEN 'nothing of an earlier epoch is left'
            ELSE pg_catalog.format('%s row(s) of earlier epochs left to sweep (epoch %s claimed %s ago)', o.sweep_backlog,
                                   o.epoch, date_trunc('second', pg_catalog.clock_timestamp() - o.claimed_at)) END,
       CASE WHEN o.sweep_backlog > 0 AND o.claimed_at <= pg_catalog.clock_timestamp() - interval '5 min'
            THEN 'nobody sweeps this lease: run pgbroker sweep, or call SELECT pgbroker.broker_sweep() until it returns 0 (the Python Broker does after its claim)' END
  FROM pgbroker.broker_overview o
UNION ALL
SELECT 'unaccounted_lock', pg_catalog.format('pid %s', u.pid), false,
       pg_catalog.format('%s (role %s, application %s, %s) holds %s %s: %s', u.pid, u.role,
                         coalesce(u.application, ''), coalesce(u.session_state, 'state unknown'), u.lock_class, u.key, u.why),
       'if it is not yours, end the session: SELECT pg_terminate_backend(' || u.pid || ');'
  FROM pgbroker.unaccounted_locks u
UNION ALL
SELECT 'broker_alive', o.name,
       o.alive OR o.state <> 'held',
       CASE WHEN o.alive THEN pg_catalog.format('epoch %s is held by pid %s', o.epoch, o.holder_pid)
            WHEN o.state <> 'held' THEN pg_catalog.format('the lease is %s', o.state)
            ELSE pg_catalog.format('epoch %s was held by pid %s, which is gone', o.epoch, o.holder_pid) END,
       CASE WHEN NOT o.alive AND o.state = 'held'
            THEN 'no broker runs for this lease: start one (it takes over with the next epoch)' END
  FROM pgbroker.broker_overview o
UNION ALL
SELECT 'upkeep', '',
       coalesce(u.last_run >= pg_catalog.clock_timestamp() - interval '1 hour', false) OR NOT u.something,
       CASE WHEN u.last_run IS NULL THEN 'maintain() never ran'
            ELSE pg_catalog.format('maintain() last ran %s ago; %s row(s) left to remove',
                                   date_trunc('second', pg_catalog.clock_timestamp() - u.last_run), u.remaining) END,
       CASE WHEN u.something AND coalesce(u.last_run < pg_catalog.clock_timestamp() - interval '1 hour', true)
            THEN 'nothing runs the upkeep: run a Python Broker, schedule SELECT pgbroker.maintain() with pg_cron (sql/README.md, "Upkeep"), or run pgbroker maintain' END
  FROM (SELECT min(l.last_run_at) AS last_run, sum(l.remaining) AS remaining,
               -- Something the upkeep would remove has waited for more than an hour.
               EXISTS (SELECT FROM pgbroker.lock_name n WHERE n.created_at < pg_catalog.clock_timestamp() - interval '1 hour')
               OR EXISTS (SELECT FROM pgbroker.rate_limit_state r
                           WHERE r.updated_at < pg_catalog.clock_timestamp() - interval '1 hour')
               OR EXISTS (SELECT FROM pgbroker.kv_entry e WHERE e.expires_at < pg_catalog.clock_timestamp() - interval '1 hour')
               OR EXISTS (SELECT FROM pgbroker.lease_event e, pgbroker.upkeep_setting s
                           WHERE e.at < pg_catalog.clock_timestamp() - s.history_retention - interval '1 hour') AS something
          FROM pgbroker.upkeep_log l) u;
COMMENT ON VIEW pgbroker.health IS
    'Health checks the database can answer: NOTIFY queue, outbox lag (60 s), watched tables'' triggers, earlier epochs left unswept 5 minutes after a claim, locks no record accounts for, dead brokers, an upkeep (maintain()) that has not run for an hour while what it removes waits. One row per check and subject; fix says what to do when ok is false.';
COMMENT ON COLUMN pgbroker.health."check" IS 'notify_queue, outbox_lag, watch_triggers, sweep, unaccounted_lock, broker_alive or upkeep.';
COMMENT ON COLUMN pgbroker.health.subject IS 'What was checked: a lease name, a watched table, or empty.';
COMMENT ON COLUMN pgbroker.health.ok IS 'False when something needs fixing.';
COMMENT ON COLUMN pgbroker.health.detail IS 'What was found.';
COMMENT ON COLUMN pgbroker.health.fix IS 'What to do about it (NULL when ok).';

-- ---------------------------------------------------------------------------
-- Prometheus: one row per sample.  Metric names are those postgres_exporter
-- gives the same figures through pgbroker/queries.yaml (<query>_<column>),
-- so a dashboard is the same whichever way it is fed.

CREATE VIEW pgbroker.metrics AS
SELECT v.metric, pg_catalog.jsonb_build_object('name', o.name) AS labels, v.value, v.help
  FROM pgbroker.broker_overview o
 CROSS JOIN LATERAL (VALUES
       ('pgbroker_broker_epoch', o.epoch::double precision,
        'Current epoch (fencing token) of the lease.'),
       ('pgbroker_broker_alive', CASE WHEN o.alive THEN 1 ELSE 0 END::double precision,
        '1 when the lease''s holder is alive, else 0.'),
       ('pgbroker_broker_heartbeat_age_seconds', EXTRACT(epoch FROM o.heartbeat_age)::double precision,
        'Seconds since the holder''s last heartbeat.'),
       ('pgbroker_broker_takeovers', o.takeovers::double precision,
        'Takeovers of the lease recorded in its history.'),
       ('pgbroker_broker_clients', o.clients::double precision,
        'Clients registered by the live holder.'),
       ('pgbroker_broker_subscriptions', o.subscriptions::double precision,
        'Subscriptions of those clients.'),
       ('pgbroker_broker_outbox_backlog', o.outbox_backlog::double precision,
        'Notifications not yet acknowledged by the broker.'),
       ('pgbroker_broker_outbox_oldest_age_seconds',
        COALESCE(EXTRACT(epoch FROM o.outbox_oldest_age), 0)::double precision,
        'Age in seconds of the oldest unacknowledged notification (0 when none).'),
       ('pgbroker_broker_sweep_backlog', o.sweep_backlog::double precision,
        'Rows earlier epochs of the lease left that broker_sweep() has yet to delete.')
     ) AS v(metric, value, help)
 WHERE v.value IS NOT NULL
UNION ALL
SELECT 'pgbroker_notify_queue_usage', '{}'::jsonb, pg_catalog.pg_notification_queue_usage(),
       'Fraction of the NOTIFY queue in use (pg_notification_queue_usage()).'
UNION ALL
-- Rate limits in aggregate (a label per name would be one series per user or
-- key): pgbroker.rate_limits has the names.
SELECT v.metric, '{}'::jsonb, v.value, v.help
  FROM (SELECT count(*) AS keys, coalesce(sum(s.allowed), 0) AS allowed, coalesce(sum(s.denied), 0) AS denied
          FROM pgbroker.rate_limit_state s) r
 CROSS JOIN LATERAL (VALUES
       ('pgbroker_rate_limit_keys', r.keys::double precision,
        'Rate limit names in use (pgbroker.rate_limits).'),
       ('pgbroker_rate_limit_allowed_total', r.allowed::double precision,
        'Rate limit calls allowed, all names together (a crash resets it).'),
       ('pgbroker_rate_limit_denied_total', r.denied::double precision,
        'Rate limit calls denied, all names together (a crash resets it).')
     ) AS v(metric, value, help)
UNION ALL
-- The upkeep, per part of maintain() (pgbroker.upkeep).
SELECT v.metric, pg_catalog.jsonb_build_object('part', u.part), v.value, v.help
  FROM pgbroker.upkeep u
 CROSS JOIN LATERAL (VALUES
       ('pgbroker_upkeep_removed_total', u.removed_total::double precision,
        'Rows maintain() removed since install, per part.'),
       ('pgbroker_upkeep_remaining', u.remaining::double precision,
        'Rows maintain() left to remove at its last call, per part (at most its max_rows counted).'),
       ('pgbroker_upkeep_last_run_age_seconds',
        EXTRACT(epoch FROM pg_catalog.clock_timestamp() - u.last_run_at)::double precision,
        'Seconds since maintain() last ran the part.')
     ) AS v(metric, value, help)
 WHERE v.value IS NOT NULL;
COMMENT ON VIEW pgbroker.metrics IS
    'Prometheus samples, one row per metric and label set: lease epoch, holder alive, heartbeat age, takeovers, clients, subscriptions, outbox backlog and oldest age, sweep backlog per broker, NOTIFY queue usage, rate limit names and calls allowed and denied, the upkeep per part.';
COMMENT ON COLUMN pgbroker.metrics.metric IS 'Metric name (the same as postgres_exporter''s through pgbroker/queries.yaml).';
COMMENT ON COLUMN pgbroker.metrics.labels IS 'Labels, as a jsonb object (name: the lease name; part: the part of maintain()).';
COMMENT ON COLUMN pgbroker.metrics.value IS 'The sample''s value.';
COMMENT ON COLUMN pgbroker.metrics.help IS 'HELP text of the metric.';
