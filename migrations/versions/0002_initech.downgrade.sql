-- Generated from sql/ by migrations/build_baseline.py: do not edit.
-- Undo pgbroker_0002_initech: stop watching initech.objects; drop it (and
-- the schema) only if this installation created them.
SELECT pgbroker.unwatch(to_regclass('initech.objects')) WHERE to_regclass('initech.objects') IS NOT NULL;
DO $initech$
BEGIN
    IF EXISTS (SELECT FROM pgbroker.installed WHERE kind = 'table' AND object = 'initech.objects') THEN
        DROP TABLE IF EXISTS initech.objects;
        DELETE FROM pgbroker.installed WHERE kind = 'table' AND object = 'initech.objects';
    END IF;
    IF EXISTS (SELECT FROM pgbroker.installed WHERE kind = 'schema' AND object = 'initech') THEN
        BEGIN
            IF to_regnamespace('initech') IS NOT NULL THEN
                REVOKE USAGE ON SCHEMA initech FROM pgbroker_broker;
            END IF;
            DROP SCHEMA IF EXISTS initech;
            DELETE FROM pgbroker.installed WHERE kind = 'schema' AND object = 'initech';
        EXCEPTION WHEN dependent_objects_still_exist THEN
            RAISE NOTICE 'schema initech kept: it holds objects pgbroker did not create';
        END;
    END IF;
END
$initech$;
