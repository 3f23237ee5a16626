package ops

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/relaytest"
)

// testPKI is a throwaway CA with a server certificate for 127.0.0.1 and a
// client certificate, written as PEM files.
type testPKI struct {
	caFile, clientCert, clientKey string
	server                        tls.Certificate
	pool                          *x509.CertPool
}

func newTestPKI(t *testing.T) testPKI {
	t.Helper()
	dir := t.TempDir()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "walbox test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	issue := func(serial int64, cn string, usage x509.ExtKeyUsage, ips []net.IP) ([]byte, *ecdsa.PrivateKey) {
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: cn}, IPAddresses: ips,
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		return der, key
	}
	write := func(name, typ string, der []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	keyDER := func(k *ecdsa.PrivateKey) []byte {
		b, err := x509.MarshalECPrivateKey(k)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	p := testPKI{caFile: write("ca.pem", "CERTIFICATE", caDER), pool: x509.NewCertPool()}
	p.pool.AddCert(ca)
	srvDER, srvKey := issue(2, "127.0.0.1", x509.ExtKeyUsageServerAuth, []net.IP{net.ParseIP("127.0.0.1")})
	p.server = tls.Certificate{Certificate: [][]byte{srvDER}, PrivateKey: srvKey}
	cliDER, cliKey := issue(3, "walbox", x509.ExtKeyUsageClientAuth, nil)
	p.clientCert = write("client.pem", "CERTIFICATE", cliDER)
	p.clientKey = write("client-key.pem", "EC PRIVATE KEY", keyDER(cliKey))
	return p
}

// TestNATSTLSWithClientCertificate connects doctor, the relay and tail over
// TLS to a server that verifies client certificates.
func TestNATSTLSWithClientCertificate(t *testing.T) {
	pki := newTestPKI(t)
	tlsOpt := func(o *server.Options) {
		o.TLS, o.TLSVerify = true, true
		o.TLSConfig = &tls.Config{Certificates: []tls.Certificate{pki.server}, ClientCAs: pki.pool,
			ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12}
	}
	e := newEnvWithNATS(t, []natstest.Option{tlsOpt}, func(c *config.Config) {
		c.NATS.TLS = config.NATSTLS{CA: pki.caFile, Cert: pki.clientCert, Key: pki.clientKey}
	})
	if err := e.cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	ctx := testCtx(t)
	e.startRelay()
	e.insert("orders.created", `{"tls":true}`)
	e.waitMsgs("ORDERS", 1)
	rep := Doctor(ctx, e.cfg)
	wantCheck(t, rep, "nats.jetstream", OK, "")
	if n, err := Tail(ctx, e.cfg, TailOptions{Subject: "orders.>", Since: time.Hour, Limit: 1}, new(relaytest.Buffer)); err != nil || n != 1 {
		t.Errorf("tail over TLS: %d %v", n, err)
	}

	// Without the client certificate the server refuses.
	noCert := e.cfg
	noCert.NATS.TLS.Cert, noCert.NATS.TLS.Key = "", ""
	if c := checkOf(t, Doctor(ctx, noCert), "nats.connect"); c.Status != Fail {
		t.Errorf("doctor without a client certificate: %+v", c)
	}
}
