package cdc

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// fakeWalsender is the server end of an in-memory replication connection
// (net.Pipe, so it also works inside a synctest bubble): it performs the
// startup handshake for pgconn, then collects the client's standby status
// updates and sends whatever CopyData frames a test gives it.
type fakeWalsender struct {
	t      *testing.T
	be     *pgproto3.Backend
	status chan statusUpdate // standby status updates the client sent
	other  chan pgproto3.FrontendMessage
	done   chan struct{} // closed when the client end is gone
}

// dialFake connects a pgconn.PgConn to a new fakeWalsender. The connection
// is closed when the test ends.
func dialFake(t *testing.T) (*pgconn.PgConn, *fakeWalsender) {
	t.Helper()
	cli, srv := net.Pipe()
	ws := &fakeWalsender{
		t:      t,
		be:     pgproto3.NewBackend(srv, srv),
		status: make(chan statusUpdate, 64),
		other:  make(chan pgproto3.FrontendMessage, 16),
		done:   make(chan struct{}),
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
		ws.other <- msg
	}
}

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
func (ws *fakeWalsender) statuses() []statusUpdate {
	var sus []statusUpdate
	for {
		select {
		case su := <-ws.status:
			sus = append(sus, su)
		default:
			return sus
		}
	}
}
