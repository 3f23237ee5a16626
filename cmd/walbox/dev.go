package main

import (
	"errors"

	"github.com/spf13/cobra"
)

func newDevCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "dev",
		Short: "Start a throwaway PostgreSQL, an embedded JetStream, the relay and a sample producer",
		RunE: func(cmd *cobra.Command, _ []string) error {
			return errors.New("not yet")
		},
	}
}
