package sweep

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// ErrNotExist is returned by ColdStore.Get for a missing object.
var ErrNotExist = errors.New("object does not exist")

// ColdStore is where archived partitions go: a local directory or an
// S3-compatible bucket. Keys use '/' as separator. Put replaces an object
// atomically: a reader sees the old object, the new one, or none.
type ColdStore interface {
	Put(ctx context.Context, key string, r io.Reader, size int64) error
	// Get returns a small object whole (manifests); ErrNotExist when missing.
	Get(ctx context.Context, key string) ([]byte, error)
	// Delete removes an object; a missing object is not an error.
	Delete(ctx context.Context, key string) error
	// List returns the keys under prefix, sorted.
	List(ctx context.Context, prefix string) ([]string, error)
	// String names the store for logs (never with credentials).
	String() string
}

// DirStore keeps objects as files under a directory.
type DirStore struct{ dir string }

// NewDirStore returns a store rooted at dir (created when missing).
func NewDirStore(dir string) (*DirStore, error) {
	if dir == "" {
		return nil, errors.New("archive directory is empty")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("archive directory: %w", err)
	}
	return &DirStore{dir: dir}, nil
}

func (d *DirStore) path(key string) (string, error) {
	clean := path.Clean("/" + key)
	if clean == "/" || strings.Contains(key, "..") {
		return "", fmt.Errorf("bad object key %q", key)
	}
	return filepath.Join(d.dir, filepath.FromSlash(clean[1:])), nil
}

// Put writes a temporary file next to the target, syncs it and renames it
// into place.
func (d *DirStore) Put(_ context.Context, key string, r io.Reader, _ int64) error {
	p, err := d.path(key)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(p), ".walbox-*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if _, err := io.Copy(f, r); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(f.Name(), p); err != nil {
		return err
	}
	if dir, err := os.Open(filepath.Dir(p)); err == nil {
		_ = dir.Sync()
		dir.Close()
	}
	return nil
}

// Get reads a file.
func (d *DirStore) Get(_ context.Context, key string) ([]byte, error) {
	p, err := d.path(key)
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, ErrNotExist
	}
	return b, err
}

// Delete removes a file.
func (d *DirStore) Delete(_ context.Context, key string) error {
	p, err := d.path(key)
	if err != nil {
		return err
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// List walks the directory.
func (d *DirStore) List(_ context.Context, prefix string) ([]string, error) {
	var keys []string
	err := filepath.WalkDir(d.dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if e.IsDir() || strings.HasPrefix(e.Name(), ".walbox-") {
			return nil
		}
		rel, err := filepath.Rel(d.dir, p)
		if err != nil {
			return err
		}
		if k := filepath.ToSlash(rel); strings.HasPrefix(k, prefix) {
			keys = append(keys, k)
		}
		return nil
	})
	sort.Strings(keys)
	return keys, err
}

func (d *DirStore) String() string { return "dir " + d.dir }

// S3Config locates an S3-compatible bucket.
type S3Config struct {
	// Endpoint is host[:port], without a scheme (s3.amazonaws.com, minio:9000).
	Endpoint string
	Bucket   string
	// Prefix is put before every key ("" for none).
	Prefix string
	// AccessKey and SecretKey; both empty: taken from AWS_ACCESS_KEY_ID /
	// AWS_SECRET_ACCESS_KEY, MINIO_ROOT_USER / MINIO_ROOT_PASSWORD, or the
	// instance's IAM role.
	AccessKey string
	SecretKey string
	UseSSL    bool
}

// S3Store keeps objects in a bucket, through minio-go.
type S3Store struct {
	c      *minio.Client
	bucket string
	prefix string
	where  string
}

// NewS3Store returns a store for the bucket. It does not connect.
func NewS3Store(cfg S3Config) (*S3Store, error) {
	c, err := NewS3Client(cfg)
	if err != nil {
		return nil, err
	}
	prefix := strings.Trim(cfg.Prefix, "/")
	where := "s3://" + cfg.Bucket + "/" + prefix
	return &S3Store{c: c, bucket: cfg.Bucket, prefix: prefix, where: where}, nil
}

// NewS3Client is the minio-go client of cfg (the bucket is cfg's to use,
// the prefix the caller's): static keys, else the environment's or the
// instance's credentials. It does not connect.
func NewS3Client(cfg S3Config) (*minio.Client, error) {
	if cfg.Endpoint == "" || cfg.Bucket == "" {
		return nil, errors.New("S3 endpoint and bucket are required")
	}
	var creds *credentials.Credentials
	if cfg.AccessKey != "" || cfg.SecretKey != "" {
		creds = credentials.NewStaticV4(cfg.AccessKey, cfg.SecretKey, "")
	} else {
		creds = credentials.NewChainCredentials([]credentials.Provider{
			&credentials.EnvAWS{}, &credentials.EnvMinio{}, &credentials.IAM{},
		})
	}
	c, err := minio.New(cfg.Endpoint, &minio.Options{Creds: creds, Secure: cfg.UseSSL})
	if err != nil {
		return nil, fmt.Errorf("S3 client for %s: %w", cfg.Endpoint, err)
	}
	return c, nil
}

func (s *S3Store) key(k string) string {
	if s.prefix == "" {
		return k
	}
	return s.prefix + "/" + k
}

// Put uploads an object (multipart for large ones; the object appears only
// when the upload completes).
func (s *S3Store) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	ct := "application/octet-stream"
	switch {
	case strings.HasSuffix(key, ".json"):
		ct = "application/json"
	case strings.HasSuffix(key, ".gz"):
		ct = "application/gzip"
	}
	_, err := s.c.PutObject(ctx, s.bucket, s.key(key), r, size, minio.PutObjectOptions{ContentType: ct})
	if err != nil {
		return fmt.Errorf("put %s/%s: %w", s.where, key, err)
	}
	return nil
}

// Get downloads a small object.
func (s *S3Store) Get(ctx context.Context, key string) ([]byte, error) {
	obj, err := s.c.GetObject(ctx, s.bucket, s.key(key), minio.GetObjectOptions{})
	if err != nil {
		return nil, s.notFound(err, key)
	}
	defer obj.Close()
	b, err := io.ReadAll(obj)
	if err != nil {
		return nil, s.notFound(err, key)
	}
	return b, nil
}

func (s *S3Store) notFound(err error, key string) error {
	if minio.ToErrorResponse(err).Code == minio.NoSuchKey {
		return ErrNotExist
	}
	return fmt.Errorf("get %s/%s: %w", s.where, key, err)
}

// Delete removes an object (S3 deletes are idempotent).
func (s *S3Store) Delete(ctx context.Context, key string) error {
	if err := s.c.RemoveObject(ctx, s.bucket, s.key(key), minio.RemoveObjectOptions{}); err != nil {
		if minio.ToErrorResponse(err).Code == minio.NoSuchKey {
			return nil
		}
		return fmt.Errorf("delete %s/%s: %w", s.where, key, err)
	}
	return nil
}

// List lists keys under prefix.
func (s *S3Store) List(ctx context.Context, prefix string) ([]string, error) {
	var keys []string
	full := s.key(prefix)
	for obj := range s.c.ListObjects(ctx, s.bucket, minio.ListObjectsOptions{Prefix: full, Recursive: true}) {
		if obj.Err != nil {
			return nil, fmt.Errorf("list %s/%s: %w", s.where, prefix, obj.Err)
		}
		k := obj.Key
		if s.prefix != "" {
			k = strings.TrimPrefix(k, s.prefix+"/")
		}
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys, nil
}

func (s *S3Store) String() string { return s.where }
