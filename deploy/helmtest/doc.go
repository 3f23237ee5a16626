// Package helmtest renders walbox's Helm chart (deploy/helm/walbox) with
// Helm's Go SDK for each values file in its ci/ folder, decodes every
// object strictly into the Kubernetes (and Prometheus operator) API types,
// and checks what the chart promises: secrets never in a ConfigMap, a
// config walbox loads, probes on the metrics port, a PodDisruptionBudget
// with more than one replica, the alerts of docs/alerts.yml, the
// security context, a grace period longer than the relay's drain, resource
// requests no smaller than the benchmark's numbers, and plain manifests in
// deploy/kubernetes that are the chart's rendering. It needs no cluster.
package helmtest
