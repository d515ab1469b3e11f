// Command kubectl is Kubernetes' kubectl at the lab's release (k8s.io/kubectl, the library the
// upstream command is a thin main over), so the lab's client is in version skew with its cluster:
// kubectl is supported one minor either way of the API server
// (https://kubernetes.io/releases/version-skew-policy/#kubectl).
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	"k8s.io/kubectl/pkg/cmd"
	"k8s.io/kubectl/pkg/cmd/util"

	// The client auth plugins, as the upstream command links them.
	_ "k8s.io/client-go/plugin/pkg/client/auth"
)

func main() {
	// The verbosity is set before the command is built, as the upstream command does.
	logs.GlogSetter(cmd.GetLogVerbosity(os.Args)) //nolint:errcheck
	if err := cli.RunNoErrOutput(cmd.NewDefaultKubectlCommand()); err != nil {
		util.CheckErr(err)
	}
}
