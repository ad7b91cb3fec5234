-- Generated from sql/ by migrations/build_baseline.py: do not edit.

-- pgbroker: the reference application table, initech.objects, watched.
--
-- Optional: install the core without it with `alembic -x initech=no upgrade head`
-- (or `pgbroker migrate --no-initech`); when loading sql/ by hand, skip this file.
-- An existing initech.objects (with a primary key) is watched as it is; one
-- created here is recorded in pgbroker.installed and dropped by a downgrade.

DO $initech$
BEGIN
    IF to_regnamespace('initech') IS NULL THEN
        CREATE SCHEMA initech;
        COMMENT ON SCHEMA initech IS 'Reference application schema of pgbroker (created by pgbroker).';
        INSERT INTO pgbroker.installed (kind, object) VALUES ('schema', 'initech');
        -- The broker names the table in subscribe() and reads the rows it subscribes to.
        GRANT USAGE ON SCHEMA initech TO pgbroker_broker;
    END IF;
    IF to_regclass('initech.objects') IS NULL THEN
        CREATE TABLE initech.objects (
            id bigint PRIMARY KEY,
            kind text NOT NULL DEFAULT 'object',
            name text,
            config jsonb NOT NULL DEFAULT '{}',
            updated_at timestamptz NOT NULL DEFAULT now()
        );
        COMMENT ON TABLE initech.objects IS 'Reference application table watched by pgbroker: changes are fanned out to subscribed clients.';
        COMMENT ON COLUMN initech.objects.id IS 'Primary key; pgbroker encodes it as a JSON number.';
        COMMENT ON COLUMN initech.objects.kind IS 'Kind of object.';
        COMMENT ON COLUMN initech.objects.name IS 'Display name.';
        COMMENT ON COLUMN initech.objects.config IS 'Configuration pushed to clients.';
        COMMENT ON COLUMN initech.objects.updated_at IS 'Last change, as set by the application.';
        GRANT SELECT ON initech.objects TO pgbroker_broker;
        INSERT INTO pgbroker.installed (kind, object) VALUES ('table', 'initech.objects');
    END IF;
END
$initech$;

SELECT pgbroker.watch('initech.objects');
