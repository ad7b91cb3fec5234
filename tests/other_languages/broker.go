// A pgbroker broker in Go with lib/pq, written from sql/README.md ("The loop
// from any language"); tests/test_other_languages.py runs it.  Build it with
// Debian's golang-go and golang-github-lib-pq-dev, offline:
//
//	GO111MODULE=off GOPATH=/usr/share/gocode go build -o broker broker.go
//
// Run it as
//
//	./broker URL NAME WAIT RUN CLIENT=KEY...
//	./broker URL primitives
//
// The first claims lease NAME (waiting up to WAIT: "0", "30 s"), subscribes each CLIENT to row KEY of
// initech.objects ("*": the whole table) and drains for RUN seconds, one JSON line per event; the second
// calls a lock, a key-value compare-and-set, a counter and a rate limit.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/lib/pq"
)

// The loop's constants, as sql/README.md gives them.
const (
	maxRows    = 1000
	linger     = 5 * time.Millisecond    // keep fetching this long once the outbox is empty ...
	lingerStep = 1 * time.Millisecond    // ... pausing this long between fetches
	batchDelay = 2 * time.Millisecond    // pause after a batch smaller than maxRows
	busyWait   = 50 * time.Millisecond   // wait after broker_sleep said 'busy'
	pollWait   = 1000 * time.Millisecond // longest wait after 'asleep': bounds a missed NOTIFY
	heartbeat  = 1000 * time.Millisecond // broker_heartbeat, for peers that claim with stale_after
)

func emit(v map[string]any) {
	line, _ := json.Marshal(v)
	fmt.Println(string(line))
}

// sqlstate is the SQLSTATE of a server error ("" for anything else).
func sqlstate(err error) string {
	var pqErr *pq.Error
	if errors.As(err, &pqErr) {
		return string(pqErr.Code)
	}
	return ""
}

func fail(err error) {
	emit(map[string]any{"error": sqlstate(err), "message": err.Error()})
	os.Exit(1)
}

func main() {
	url := os.Args[1]
	db, err := sql.Open("postgres", url)
	if err != nil {
		fail(err)
	}
	ctx := context.Background()
	// A session lease belongs to one server session: keep one connection (database/sql pools them).
	conn, err := db.Conn(ctx)
	if err != nil {
		fail(err)
	}
	if os.Args[2] == "primitives" {
		err = primitives(ctx, conn)
	} else {
		run, _ := strconv.ParseFloat(os.Args[4], 64)
		err = broker(ctx, conn, url, os.Args[2], os.Args[3], time.Duration(run*float64(time.Second)), os.Args[5:])
	}
	if err != nil {
		fail(err)
	}
}

type notification struct {
	id      int64
	op      string
	key     json.RawMessage
	clients []string
}

func broker(ctx context.Context, conn *sql.Conn, url, name, wait string, run time.Duration, subs []string) error {
	var epoch int64
	err := conn.QueryRowContext(ctx, "SELECT pgbroker.broker_claim($1, wait => $2)", name, wait).Scan(&epoch)
	if sqlstate(err) == "55P03" { // held by another session: its DETAIL names the holder
		emit(map[string]any{"refused": "55P03", "holder": json.RawMessage(err.(*pq.Error).Detail)})
		os.Exit(3)
	} else if err != nil {
		return err
	}
	// LISTEN before the first broker_sleep.  lib/pq reads notifications only on a pq.Listener,
	// a connection of its own; after it reconnects it sends nil, and the loop fetches.
	var channel string
	if err := conn.QueryRowContext(ctx, "SELECT pgbroker.wakeup_channel($1)", name).Scan(&channel); err != nil {
		return err
	}
	listener := pq.NewListener(url, 10*time.Millisecond, time.Second, nil)
	defer listener.Close()
	if err := listener.Listen(channel); err != nil {
		return err
	}
	for _, sub := range subs {
		client, key, _ := strings.Cut(sub, "=")
		if _, err := conn.ExecContext(ctx, "SELECT pgbroker.client_register($1, '{}', $2)", client, name); err != nil {
			return err
		}
		var row any = key // a jsonb key; NULL: the whole table
		if key == "*" {
			row = nil
		}
		_, err := conn.ExecContext(ctx, "SELECT pgbroker.subscribe($1, 'initech.objects', $2, $3)", client, row, name)
		if err != nil {
			return err
		}
	}
	var pid int
	_ = conn.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid)
	emit(map[string]any{"ready": true, "epoch": epoch, "pid": pid})

	exec := func(query string) error { _, err := conn.ExecContext(ctx, query, name); return err }
	if err := exec("SELECT pgbroker.broker_wake($1)"); err != nil {
		return err
	}
	var ack []int64 // the previous batch, acknowledged by the next fetch
	var idleSince time.Time
	lastBeat := time.Now()
	for until := time.Now().Add(run); time.Now().Before(until); {
		if time.Since(lastBeat) >= heartbeat {
			if err := exec("SELECT pgbroker.broker_heartbeat($1)"); err != nil {
				return err
			}
			lastBeat = time.Now()
		}
		batch, err := fetch(ctx, conn, name, ack)
		if err != nil {
			return err // PB001 or a broken connection: the lease is gone
		}
		ack = nil
		if len(batch) > 0 {
			for _, n := range batch { // hand it on: here, print it
				emit(map[string]any{"id": n.id, "op": n.op, "key": n.key, "clients": n.clients})
				ack = append(ack, n.id)
			}
			idleSince = time.Time{}
			if len(batch) < maxRows {
				time.Sleep(batchDelay)
			}
			continue
		}
		if idleSince.IsZero() {
			idleSince = time.Now()
		}
		if time.Since(idleSince) < linger {
			time.Sleep(lingerStep)
			continue
		}
		idleSince = time.Time{}
		var state string
		if err := conn.QueryRowContext(ctx, "SELECT pgbroker.broker_sleep($1)", name).Scan(&state); err != nil {
			return err
		}
		if state == "pending" { // rows arrived: still awake, fetch again
			continue
		}
		timeout := pollWait // 'asleep': the next writer notifies
		if state == "busy" {
			timeout = busyWait // a writer is still open: still awake, look again soon
		}
		select {
		case <-listener.Notify: // nil after a reconnect: fetch anyway
		case <-time.After(timeout):
		}
		if err := exec("SELECT pgbroker.broker_wake($1)"); err != nil {
			return err
		}
	}
	if len(ack) > 0 {
		if _, err := conn.ExecContext(ctx, "SELECT pgbroker.outbox_ack($1, $2)", name, pq.Array(ack)); err != nil {
			return err
		}
	}
	return exec("SELECT pgbroker.broker_release($1)")
}

func fetch(ctx context.Context, conn *sql.Conn, name string, ack []int64) ([]notification, error) {
	var acked any // NULL when there is nothing to acknowledge
	if len(ack) > 0 {
		acked = pq.Array(ack)
	}
	rows, err := conn.QueryContext(ctx,
		"SELECT id, op, key, clients FROM pgbroker.outbox_fetch($1, $2, ack => $3)", name, maxRows, acked)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var batch []notification
	for rows.Next() {
		var n notification
		var key []byte
		if err := rows.Scan(&n.id, &n.op, &key, pq.Array(&n.clients)); err != nil {
			return nil, err
		}
		if key == nil {
			key = []byte("null") // a truncate names no row
		}
		n.key = key
		batch = append(batch, n)
	}
	return batch, rows.Err()
}

// primitives calls a lock, a key-value compare-and-set, a counter and a rate limit, and one call
// with a bad argument, caught by its SQLSTATE.  lib/pq sends parameters untyped: no casts needed.
func primitives(ctx context.Context, conn *sql.Conn) error {
	var locked, unlocked bool
	if err := conn.QueryRowContext(ctx, "SELECT pgbroker.lock_acquire($1, wait => $2)", "lang/lock", "1 s").Scan(&locked); err != nil {
		return err
	}
	if err := conn.QueryRowContext(ctx, "SELECT pgbroker.lock_release($1)", "lang/lock").Scan(&unlocked); err != nil {
		return err
	}
	var first, second int64
	var third sql.NullInt64 // NULL: the compare-and-set lost
	set := "SELECT pgbroker.kv_set($1, $2, version => $3)"
	if err := conn.QueryRowContext(ctx, set, "lang/key", `{"n": 1}`, 0).Scan(&first); err != nil {
		return err
	}
	if err := conn.QueryRowContext(ctx, set, "lang/key", `{"n": 2}`, first).Scan(&second); err != nil {
		return err
	}
	if err := conn.QueryRowContext(ctx, set, "lang/key", `{"n": 3}`, first).Scan(&third); err != nil {
		return err
	}
	var counter int64
	if err := conn.QueryRowContext(ctx, "SELECT pgbroker.counter_add($1, $2)", "lang/counter", 5).Scan(&counter); err != nil {
		return err
	}
	var allowed bool
	var remaining int
	limit := "SELECT allowed, remaining FROM pgbroker.rate_limit($1, $2, $3)"
	if err := conn.QueryRowContext(ctx, limit, "lang/rate", 2, "1 second").Scan(&allowed, &remaining); err != nil {
		return err
	}
	bad := conn.QueryRowContext(ctx, limit, "lang/rate", 0, "1 second").Scan(&allowed, &remaining)
	if sqlstate(bad) != "22023" { // invalid_parameter_value: a rate must be positive
		return fmt.Errorf("a rate of 0 should fail with 22023, got %v", bad)
	}
	emit(map[string]any{
		"lock": []bool{locked, unlocked}, "kv": []any{first, second, third.Valid}, "counter": counter,
		"rate_limit": []any{allowed, remaining}, "bad": sqlstate(bad),
	})
	return nil
}
