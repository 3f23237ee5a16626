package main

import (
	_ "embed"
	"fmt"

	"github.com/spf13/cobra"
)

// exampleConfig is testdata/walbox.yaml: every key with its default, its
// environment variable and what it does (a test keeps the copies equal).
//
//go:embed walbox.example.yaml
var exampleConfig string

func newConfigCmd() *cobra.Command {
	return newGroupCmd("config", "Configuration helpers", &cobra.Command{
		Use:   "example",
		Short: "Print the full reference configuration: every key, its default, its WALBOX_* variable and what it does",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, err := fmt.Fprint(cmd.OutOrStdout(), exampleConfig)
			return err
		},
	})
}
