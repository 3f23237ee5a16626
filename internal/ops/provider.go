package ops

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// provider is a managed PostgreSQL, recognised by a setting only it has,
// with where logical decoding is turned on and the role that grants
// replication where the REPLICATION attribute cannot be given.
type provider struct {
	Name string
	// Setting exists only on this provider (custom GUCs are readable by
	// everyone through current_setting(name, true)).
	Setting string
	// WALFix turns on logical decoding where ALTER SYSTEM is not allowed.
	WALFix string
	// ReplicationRole, when set, gives replication to its members.
	ReplicationRole string
	RoleFix         string
}

// providers are the managed PostgreSQL services doctor recognises
// (docs/managed-postgres.md).
var providers = []provider{
	{Name: "Amazon RDS / Aurora", Setting: "rds.logical_replication",
		WALFix:          "set rds.logical_replication = 1 in the instance's (Aurora: the cluster's) parameter group and reboot: ALTER SYSTEM is not allowed on RDS",
		ReplicationRole: "rds_replication", RoleFix: "GRANT rds_replication TO <role>; (as the master user)"},
	{Name: "Google Cloud SQL", Setting: "cloudsql.logical_decoding",
		WALFix:  "gcloud sql instances patch <instance> --database-flags=cloudsql.logical_decoding=on (restarts the instance): ALTER SYSTEM is not allowed on Cloud SQL",
		RoleFix: "ALTER USER <role> WITH REPLICATION; (as a cloudsqlsuperuser member)"},
	{Name: "Azure Database for PostgreSQL flexible server", Setting: "azure.replication_support",
		WALFix:  "az postgres flexible-server parameter set --name wal_level --value logical (and azure.replication_support = logical where it exists), then restart the server: ALTER SYSTEM is not allowed on Azure",
		RoleFix: "ALTER ROLE <role> WITH REPLICATION; (as an azure_pg_admin member)"},
	{Name: "Neon", Setting: "neon.timeline_id",
		WALFix:  "turn on logical replication in the project's settings (Neon console, Settings, Logical replication): it sets wal_level = logical",
		RoleFix: "roles made in the Neon console can replicate: use one of them"},
	{Name: "Supabase", Setting: "pgsodium.getkey_script",
		WALFix:  "wal_level is logical on Supabase; if not, contact support",
		RoleFix: "use the postgres role, or ALTER ROLE <role> WITH REPLICATION; as postgres"},
}

// detectProvider recognises a managed PostgreSQL by its settings.
func detectProvider(ctx context.Context, conn *pgx.Conn) *provider {
	for i := range providers {
		var v *string
		if err := conn.QueryRow(ctx, `SELECT current_setting($1, true)`, providers[i].Setting).Scan(&v); err == nil && v != nil {
			return &providers[i]
		}
	}
	return nil
}
