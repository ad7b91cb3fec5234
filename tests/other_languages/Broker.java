// A pgbroker broker in Java with PgJDBC, written from sql/README.md ("The loop from any language");
// tests/test_other_languages.py runs it.  With Debian's default-jdk-headless and libpostgresql-jdbc-java:
//
//     java -cp /usr/share/java/postgresql.jar Broker.java JDBC_URL NAME WAIT RUN CLIENT=KEY...
//     java -cp /usr/share/java/postgresql.jar Broker.java JDBC_URL primitives
//
// The first claims lease NAME (waiting up to WAIT: "0", "30 s"), subscribes each CLIENT to row KEY of
// initech.objects ("*": the whole table) and drains for RUN seconds, one JSON line per event; the second
// calls a lock, a key-value compare-and-set, a counter and a rate limit.
//
// PgJDBC sends a String as varchar, and no function takes varchar for an interval, jsonb or regclass:
// cast those parameters (?::interval, ?::jsonb), or connect with stringtype=unspecified.

import java.sql.Array;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.util.ArrayList;
import java.util.List;
import org.postgresql.PGConnection;
import org.postgresql.util.PSQLException;

public class Broker {
    // The loop's constants, as sql/README.md gives them (milliseconds).
    static final int MAX_ROWS = 1000;
    static final long LINGER = 5, LINGER_STEP = 1; // keep fetching 5 ms once empty, 1 ms apart
    static final long BATCH_DELAY = 2;             // pause after a batch smaller than MAX_ROWS
    static final int BUSY_WAIT = 50;               // wait after broker_sleep said 'busy'
    static final int POLL_WAIT = 1000;             // longest wait after 'asleep': bounds a missed NOTIFY
    static final long HEARTBEAT = 1000;            // broker_heartbeat, for peers that claim with stale_after

    public static void main(String[] args) throws Exception {
        // One connection, autocommit (the default): the lease belongs to its session.
        try (Connection db = DriverManager.getConnection(args[0])) {
            if (args[1].equals("primitives")) {
                primitives(db);
            } else {
                List<String> subs = List.of(args).subList(4, args.length);
                broker(db, args[1], args[2], (long) (Double.parseDouble(args[3]) * 1000), subs);
            }
        } catch (SQLException e) {
            System.out.println("{\"error\": " + quote(e.getSQLState()) + ", \"message\": " + quote(e.getMessage()) + "}");
            System.exit(1);
        }
    }

    static void broker(Connection db, String name, String wait, long runMillis, List<String> subs) throws Exception {
        long epoch;
        try {
            epoch = one(db, "SELECT pgbroker.broker_claim(?, wait => ?::interval)", name, wait).getLong(1);
        } catch (PSQLException e) {
            if (!"55P03".equals(e.getSQLState())) throw e;
            // Held by another session: the DETAIL is a JSON object naming the holder.
            System.out.println("{\"refused\": \"55P03\", \"holder\": " + e.getServerErrorMessage().getDetail() + "}");
            System.exit(3);
            return;
        }
        // LISTEN before the first broker_sleep; PgJDBC queues what arrives during other statements.
        String channel = one(db, "SELECT pgbroker.wakeup_channel(?)", name).getString(1);
        db.createStatement().execute("LISTEN \"" + channel + "\"");
        PGConnection pg = db.unwrap(PGConnection.class);
        for (String sub : subs) {
            String client = sub.substring(0, sub.indexOf('=')), key = sub.substring(sub.indexOf('=') + 1);
            one(db, "SELECT pgbroker.client_register(?, '{}', ?)", client, name);
            one(db, "SELECT pgbroker.subscribe(?, 'initech.objects', ?::jsonb, ?)", client, key.equals("*") ? null : key, name);
        }
        long pid = one(db, "SELECT pg_backend_pid()").getLong(1);
        System.out.println("{\"ready\": true, \"epoch\": " + epoch + ", \"pid\": " + pid + "}");

        one(db, "SELECT pgbroker.broker_wake(?)", name);
        List<Long> ack = new ArrayList<>(); // the previous batch, acknowledged by the next fetch
        long idleSince = -1, lastBeat = System.currentTimeMillis();
        PreparedStatement fetch = db.prepareStatement("SELECT id, op, key, clients FROM pgbroker.outbox_fetch(?, ?, ack => ?)");
        fetch.setString(1, name);
        fetch.setInt(2, MAX_ROWS);
        for (long until = System.currentTimeMillis() + runMillis; System.currentTimeMillis() < until; ) {
            if (System.currentTimeMillis() - lastBeat >= HEARTBEAT) {
                one(db, "SELECT pgbroker.broker_heartbeat(?)", name);
                lastBeat = System.currentTimeMillis();
            }
            fetch.setArray(3, db.createArrayOf("bigint", ack.toArray()));
            ack.clear();
            try (ResultSet rs = fetch.executeQuery()) { // PB001 or a broken connection: the lease is gone
                while (rs.next()) { // hand it on: here, print it
                    StringBuilder clients = new StringBuilder();
                    for (Object c : (Object[]) rs.getArray("clients").getArray()) {
                        clients.append(clients.length() == 0 ? "" : ", ").append(quote((String) c));
                    }
                    System.out.println("{\"id\": " + rs.getLong("id") + ", \"op\": " + quote(rs.getString("op"))
                        + ", \"key\": " + rs.getString("key") + ", \"clients\": [" + clients + "]}");
                    ack.add(rs.getLong("id"));
                }
            }
            if (!ack.isEmpty()) {
                idleSince = -1;
                if (ack.size() < MAX_ROWS) Thread.sleep(BATCH_DELAY);
                continue;
            }
            if (idleSince < 0) idleSince = System.currentTimeMillis();
            if (System.currentTimeMillis() - idleSince < LINGER) {
                Thread.sleep(LINGER_STEP);
                continue;
            }
            idleSince = -1;
            String state = one(db, "SELECT pgbroker.broker_sleep(?)", name).getString(1);
            if (state.equals("pending")) continue; // rows arrived: still awake, fetch again
            // 'asleep': the next writer notifies; 'busy': a writer is still open, look again soon.
            pg.getNotifications(state.equals("busy") ? BUSY_WAIT : POLL_WAIT);
            one(db, "SELECT pgbroker.broker_wake(?)", name);
        }
        if (!ack.isEmpty()) one(db, "SELECT pgbroker.outbox_ack(?, ?)", name, db.createArrayOf("bigint", ack.toArray()));
        one(db, "SELECT pgbroker.broker_release(?)", name);
    }

    // A lock, a key-value compare-and-set, a counter and a rate limit, and one call with a bad
    // argument, caught by its SQLSTATE.  Strings for interval and jsonb parameters are cast.
    static void primitives(Connection db) throws SQLException {
        boolean locked = one(db, "SELECT pgbroker.lock_acquire(?, wait => ?::interval)", "lang/lock", "1 s").getBoolean(1);
        boolean unlocked = one(db, "SELECT pgbroker.lock_release(?)", "lang/lock").getBoolean(1);
        String set = "SELECT pgbroker.kv_set(?, ?::jsonb, version => ?)";
        long first = one(db, set, "lang/key", "{\"n\": 1}", 0L).getLong(1);
        long second = one(db, set, "lang/key", "{\"n\": 2}", first).getLong(1);
        ResultSet third = one(db, set, "lang/key", "{\"n\": 3}", first);
        third.getLong(1);
        boolean thirdWon = !third.wasNull(); // NULL: the compare-and-set lost
        long counter = one(db, "SELECT pgbroker.counter_add(?, ?)", "lang/counter", 5L).getLong(1);
        String limit = "SELECT allowed, remaining FROM pgbroker.rate_limit(?, ?, ?::interval)";
        ResultSet rate = one(db, limit, "lang/rate", 2, "1 second");
        String bad = null;
        try {
            one(db, limit, "lang/rate", 0, "1 second");
        } catch (SQLException e) {
            bad = e.getSQLState(); // 22023 invalid_parameter_value: a rate must be positive
        }
        if (!"22023".equals(bad)) throw new SQLException("a rate of 0 should fail with 22023, got " + bad);
        // Without its cast, the jsonb parameter goes as varchar and no kv_set takes that: 42883, though
        // pgbroker is installed, as schema_version() (no parameters) shows.  That is how to tell the two apart.
        String uncast = null;
        try {
            one(db, "SELECT pgbroker.kv_set(?, ?)", "lang/other", "{}");
        } catch (SQLException e) {
            uncast = e.getSQLState();
        }
        String installed = one(db, "SELECT pgbroker.schema_version()").getString(1);
        System.out.println("{\"lock\": [" + locked + ", " + unlocked + "], \"kv\": [" + first + ", " + second + ", "
            + thirdWon + "], \"counter\": " + counter + ", \"rate_limit\": [" + rate.getBoolean(1) + ", "
            + rate.getInt(2) + "], \"bad\": " + quote(bad) + ", \"uncast\": " + quote(uncast) + ", \"installed\": "
            + quote(installed) + "}");
    }

    // Run a statement with these parameters; its result set, on its first row.
    static ResultSet one(Connection db, String sql, Object... params) throws SQLException {
        PreparedStatement st = db.prepareStatement(sql);
        st.closeOnCompletion();
        for (int i = 0; i < params.length; i++) st.setObject(i + 1, params[i]);
        ResultSet rs = st.executeQuery();
        rs.next();
        return rs;
    }

    static String quote(String s) {
        if (s == null) return "null";
        StringBuilder out = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            if (c == '"' || c == '\\') out.append('\\').append(c);
            else if (c < 0x20) out.append(String.format("\\u%04x", (int) c));
            else out.append(c);
        }
        return out.append('"').toString();
    }
}
