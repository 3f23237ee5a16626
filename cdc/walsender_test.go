package cdc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// fakeWalsender is the server end of an in-memory replication connection
// (net.Pipe, so it also works inside a synctest bubble): it performs the
// startup handshake for pgconn, answers simple-protocol queries with what
// the test says, collects the client's standby status updates, and sends
// whatever CopyData frames a test gives it.
type fakeWalsender struct {
	t       *testing.T
	be      *pgproto3.Backend
	answer  func(sql string) fakeResult
	queries chan string       // the SQL the client ran, in order
	status  chan statusUpdate // standby status updates the client sent
	other   chan pgproto3.FrontendMessage
	done    chan struct{} // closed when the client end is gone
}

// fakeResult is the answer to one query: rows of text values (nil for
// NULL), or an error.
type fakeResult struct {
	rows [][]*string
	err  *pgproto3.ErrorResponse
	tag  string // command tag; default SELECT n
}

// rows builds a fakeResult from rows of non-NULL text values.
func rows(rs ...[]string) fakeResult {
	r := fakeResult{rows: [][]*string{}}
	for _, row := range rs {
		vals := make([]*string, len(row))
		for i := range row {
			vals[i] = &row[i]
		}
		r.rows = append(r.rows, vals)
	}
	return r
}

// sqlError is a failed query's answer.
func sqlError(code, msg string) fakeResult {
	return fakeResult{err: &pgproto3.ErrorResponse{Severity: "ERROR", Code: code, Message: msg}}
}

// dialFake connects a pgconn.PgConn to a new fakeWalsender that answers
// queries with answer (nil: no query is expected). The connection is closed
// when the test ends.
func dialFake(t *testing.T, answer func(sql string) fakeResult) (*pgconn.PgConn, *fakeWalsender) {
	t.Helper()
	cli, srv := net.Pipe()
	ws := &fakeWalsender{
		t:       t,
		be:      pgproto3.NewBackend(srv, srv),
		answer:  answer,
		queries: make(chan string, 64),
		status:  make(chan statusUpdate, 64),
		other:   make(chan pgproto3.FrontendMessage, 16),
		done:    make(chan struct{}),
	}
	handshake := make(chan error, 1)
	go func() { handshake <- ws.handshake() }()

	cfg, err := pgconn.ParseConfig("host=127.0.0.1 port=5432 user=walbox database=app sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	dialed := false
	cfg.DialFunc = func(context.Context, string, string) (net.Conn, error) {
		if dialed {
			return nil, errors.New("fake walsender: one connection only")
		}
		dialed = true
		return cli, nil
	}
	conn, err := pgconn.ConnectConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("connect to the fake walsender: %v", err)
	}
	if err := <-handshake; err != nil {
		t.Fatalf("fake walsender handshake: %v", err)
	}
	go ws.read(srv)
	t.Cleanup(func() {
		_ = conn.Close(context.Background())
		_ = srv.Close()
		<-ws.done
	})
	return conn, ws
}

func (ws *fakeWalsender) handshake() error {
	if _, err := ws.be.ReceiveStartupMessage(); err != nil {
		return err
	}
	ws.be.Send(&pgproto3.AuthenticationOk{})
	ws.be.Send(&pgproto3.ParameterStatus{Name: "server_version", Value: "17.0"})
	ws.be.Send(&pgproto3.BackendKeyData{ProcessID: 4242, SecretKey: []byte{0, 0, 0, 1}})
	ws.be.Send(&pgproto3.ReadyForQuery{TxStatus: 'I'})
	return ws.be.Flush()
}

// read drains what the client sends until it hangs up.
func (ws *fakeWalsender) read(srv net.Conn) {
	defer close(ws.done)
	defer srv.Close()
	for {
		msg, err := ws.be.Receive()
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrClosedPipe) {
				ws.t.Logf("fake walsender: receive: %v", err)
			}
			return
		}
		if cd, ok := msg.(*pgproto3.CopyData); ok {
			if su, ok := parseStatusUpdate(cd.Data); ok {
				ws.status <- su
				continue
			}
		}
		if _, ok := msg.(*pgproto3.Terminate); ok {
			return
		}
		if q, ok := msg.(*pgproto3.Query); ok && ws.answer != nil {
			ws.queries <- q.String
			if err := ws.reply(ws.answer(q.String)); err != nil {
				ws.t.Logf("fake walsender: reply: %v", err)
				return
			}
			continue
		}
		ws.other <- msg
	}
}

// reply answers a simple-protocol query.
func (ws *fakeWalsender) reply(r fakeResult) error {
	if r.err != nil {
		ws.be.Send(r.err)
	} else {
		if len(r.rows) > 0 {
			var fields []pgproto3.FieldDescription
			for i := range r.rows[0] {
				fields = append(fields, pgproto3.FieldDescription{Name: []byte(fmt.Sprintf("c%d", i)), DataTypeOID: oidText, DataTypeSize: -1, TypeModifier: -1})
			}
			ws.be.Send(&pgproto3.RowDescription{Fields: fields})
		}
		for _, row := range r.rows {
			var vals [][]byte
			for _, v := range row {
				if v == nil {
					vals = append(vals, nil)
				} else {
					vals = append(vals, []byte(*v))
				}
			}
			ws.be.Send(&pgproto3.DataRow{Values: vals})
		}
		tag := r.tag
		if tag == "" {
			tag = fmt.Sprintf("SELECT %d", len(r.rows))
		}
		ws.be.Send(&pgproto3.CommandComplete{CommandTag: []byte(tag)})
	}
	ws.be.Send(&pgproto3.ReadyForQuery{TxStatus: 'I'})
	return ws.be.Flush()
}

// ran returns the SQL the client has run so far.
func (ws *fakeWalsender) ran() []string { return pending(ws.queries) }

// send writes backend messages to the client; with net.Pipe it returns once
// the client has read them, so call it from its own goroutine when the
// client is not reading yet.
func (ws *fakeWalsender) send(msgs ...pgproto3.BackendMessage) error {
	for _, m := range msgs {
		ws.be.Send(m)
	}
	return ws.be.Flush()
}

// statuses returns the status updates the client has sent so far. In a
// synctest bubble call it after synctest.Wait, so that every write the
// client made has been read.
func (ws *fakeWalsender) statuses() []statusUpdate { return pending(ws.status) }
