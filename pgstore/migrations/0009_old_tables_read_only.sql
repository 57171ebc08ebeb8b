-- A binary of schema version 5 still running after migration 0006 only
-- logs that the schema is newer, and keeps claiming in the old tables: a
-- key whose old record a new binary has moved (or a key that only the new
-- table has) is absent there, so the old binary acquired it again and
-- applied it twice. The old tables now refuse every insert (the claim of
-- version 5 is an INSERT ... ON CONFLICT, which fires the trigger first),
-- so an old binary fails closed until it is upgraded; the conversion only
-- deletes from them (TestOldBinaryRefusedAfterMigration).
CREATE FUNCTION {{t:old_records_moved}}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'dedup: the records moved to the compact tables (schema version 6); upgrade this binary'
        USING ERRCODE = 'read_only_sql_transaction';
END
$$;
DO $$
BEGIN
    IF to_regclass('{{t:records}}') IS NOT NULL THEN
        CREATE TRIGGER moved BEFORE INSERT ON {{t:records}} FOR EACH ROW EXECUTE FUNCTION {{t:old_records_moved}}();
    END IF;
    IF to_regclass('{{t:records_p}}') IS NOT NULL THEN
        CREATE TRIGGER moved BEFORE INSERT ON {{t:records_p}} FOR EACH ROW EXECUTE FUNCTION {{t:old_records_moved}}();
    END IF;
END
$$;
